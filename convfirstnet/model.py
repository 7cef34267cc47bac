"""ConvFirstNet (A. Lavin, "On the Efficiency of Convolutional Neural Networks", 2024; arXiv 2404.03617).

Stem and three ConvFirst stages (grouped 3x3 conv before a 1x1 FFN) at high resolution, two MBConv +
Squeeze-Excite stages at low resolution, a 1x1 conv head to 1280 features. Sizes are rows of
``convfirstnet.registry.SIZES``, read from the paper's Table 3; timm registers
``convfirstnet_{pico,nano,tiny,small}``.
"""

from __future__ import annotations

from typing import Any, Sequence

import timm.models._factory
import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, checkpoint_seq, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices  # where timm's own models import it from

from .blocks import MIN_INPUT_SIZE, ConvFirst, Head, MBConv, Stem, check_input
from .registry import MODEL_NAMES, SIZES, Stage
from .weights import checkpoint_num_classes, clean_state_dict, load_weights, resolve_weights


class ConvFirstNet(nn.Module):
    """ConvFirstNet classifier, timm conventions (``forward_features`` / ``forward_head`` / ...).

    ``forward_features`` returns the last stage's map (``num_features`` channels, stride 32);
    ``forward_head`` runs the 1x1 conv head, SiLU and average pool (``head_hidden_size`` = 1280,
    what ``pre_logits=True`` returns), dropout and the classifier.
    """

    def __init__(
        self,
        stem_chs: int,
        stages: Sequence[Stage],
        num_classes: int = 1000,
        in_chans: int = 3,
        head_chs: int = 1280,
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        _check_global_pool(global_pool)
        _check_num_classes(num_classes)
        if in_chans < 1:
            raise ValueError(f"ConvFirstNet: in_chans must be at least 1, got {in_chans}")
        for arg, rate in (("drop_rate", drop_rate), ("drop_path_rate", drop_path_rate)):
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"ConvFirstNet: {arg} must be in [0, 1), got {rate}")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.grad_checkpointing = False
        self.stem = Stem(in_chans, stem_chs)

        # Stochastic depth grows linearly over the residual (stride-1) blocks, as in timm.
        num_blocks = sum(s.depth for s in stages)
        rates = torch.linspace(0, drop_path_rate, num_blocks).tolist()
        blocks_done, c_in, reduction = 0, stem_chs, 2
        self.feature_info = []
        stage_modules = []
        for i, st in enumerate(stages):
            blocks = []
            for j in range(st.depth):
                stride = st.stride if j == 0 else 1
                dpr = rates[blocks_done + j]
                if st.block == "convfirst":
                    blocks.append(ConvFirst(c_in, st.channels, stride, st.expansion, drop_path=dpr))
                else:
                    blocks.append(MBConv(c_in, st.channels, stride, st.expansion, drop_path=dpr))
                c_in = st.channels
            blocks_done += st.depth
            reduction *= st.stride
            stage_modules.append(nn.Sequential(*blocks))
            self.feature_info.append(dict(num_chs=c_in, reduction=reduction, module=f"stages.{i}"))
        self.stages = nn.Sequential(*stage_modules)
        self.num_features = c_in
        self.head_hidden_size = head_chs
        self.head = Head(c_in, head_chs)
        self.head_drop = nn.Dropout(drop_rate)
        self.classifier = nn.Linear(head_chs, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    # timm model interface --------------------------------------------------------------------
    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return dict(
            stem=r"^stem",
            blocks=r"^stages\.(\d+)" if coarse else [(r"^stages\.(\d+)\.(\d+)", None), (r"^head\.", (99999,))],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return set()  # timm's optimizer factory already exempts biases and BatchNorm

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.classifier

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool is not None:
            _check_global_pool(global_pool)
        _check_num_classes(num_classes)
        self.num_classes = num_classes
        device, dtype = self.head_device_dtype()
        self.classifier = (
            nn.Linear(self.head_hidden_size, num_classes, device=device, dtype=dtype) if num_classes > 0 else nn.Identity()
        )

    def head_device_dtype(self) -> tuple[torch.device, torch.dtype]:
        p = next(self.parameters())
        return p.device, p.dtype

    def load_pretrained(self, path: str) -> None:
        """Called by timm for ``pretrained=True`` (pretrained_cfg ``custom_load``, which ``_create`` sets
        for a weight file): the package's loader, checks and errors (``convfirstnet.weights.load_weights``)."""
        load_weights(self, path, use_ema=True)  # EMA weights first, as timm's load_checkpoint

    # forward ----------------------------------------------------------------------------------
    def check_input(self, x: torch.Tensor) -> None:
        """The stem runs this on every forward (see :func:`convfirstnet.blocks.check_input`)."""
        check_input(x, self.in_chans, next(self.stem.parameters()))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # checks the input
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.stages, x)
        return self.stages(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | Sequence[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """timm's feature API: the outputs of stages ``indices`` (the five ``feature_info`` entries, strides
        2..32; what ``features_only=True`` returns), and the final ``forward_features`` map.

        ``indices``: last n stages if int, all if None, these stages if a sequence (negative from the end).
        ``norm``: accepted for timm compatibility; ConvFirstNet has no norm after its last stage.
        ``stop_early``: run no stage after the last one taken. ``output_fmt``: ``"NCHW"`` only (the fused
        form's maps are NCHW tensors in channels-last memory). Returns the list of intermediates if
        ``intermediates_only``, else ``(final map, intermediates)``.
        """
        if output_fmt != "NCHW":
            raise ValueError(f"ConvFirstNet: output_fmt must be 'NCHW', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        intermediates = []
        x = self.stem(x)  # checks the input
        stages = self.stages[: max_index + 1] if stop_early else self.stages
        for i, stage in enumerate(stages):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint_seq(stage, x)
            else:
                x = stage(x)
            if i in take_indices:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        return x, intermediates

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the stages after the last of ``indices`` and, with ``prune_head`` (or when stages were
        dropped: the head is sized for the last stage), the head and classifier, so that ``forward_head``
        passes the feature map through. ``prune_norm`` has nothing to prune. Returns the kept indices."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        prune_end = max_index < len(self.stages) - 1
        self.stages = self.stages[: max_index + 1]
        if prune_end:
            self.num_features = self.feature_info[max_index]["num_chs"]
        if prune_head or prune_end:
            self.head = nn.Identity()
            self.head_drop = nn.Identity()
            self.classifier = nn.Identity()
            self.num_classes = 0
            self.head_hidden_size = self.num_features
        return take_indices

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.head(x))
        return x if pre_logits else self.classifier(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _check_global_pool(global_pool: str) -> None:
    if global_pool != "avg":
        raise ValueError(f"ConvFirstNet's head fuses average pooling; global_pool={global_pool!r} is not supported")


def _check_num_classes(num_classes: int) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
        raise ValueError(
            f"ConvFirstNet: num_classes must be an integer >= 0 (0: no classifier), got {num_classes!r}"
        )


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """timm hook for ``pretrained_cfg`` loads: strip wrapper prefixes (DDP ``module.``, compile ``_orig_mod.``)."""
    return clean_state_dict(state_dict)


# pretrained_cfg keys that name a weight source other than a local file: those load through timm's own code.
_OTHER_SOURCES = ("url", "hf_hub_id", "state_dict")


def _create(variant: str, pretrained: bool = False, **kwargs: Any) -> ConvFirstNet:
    """timm's entry point, and the one weight lookup of the package (``convfirstnet.create_model`` calls
    ``timm.create_model``). Returns the training form (BatchNorm) in train mode, timm's convention, with
    or without weights; ``convfirstnet.fuse`` makes the inference form.

    With ``pretrained=True`` the weight file (``pretrained_cfg_overlay`` ``file``, else the package's
    lookup) is found first, so a missing file raises a ``WeightsNotFoundError`` naming it; its class
    count becomes the pretrained_cfg's ``num_classes`` (the model's too, unless the caller passes
    ``num_classes``); and it loads through ``ConvFirstNet.load_pretrained`` (``custom_load``), so timm's
    path has the package's formats, checks and errors.
    """
    size = SIZES[variant.removeprefix("convfirstnet_")]
    if pretrained:
        overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
        if not any(overlay.get(k) for k in _OTHER_SOURCES):
            path = resolve_weights(variant, overlay.get("file") or None)
            overlay["file"] = str(path)
            overlay.setdefault("custom_load", True)  # timm resets it to False for an overlaid file
            num_classes = checkpoint_num_classes(path)
            if num_classes is not None:
                overlay.setdefault("num_classes", num_classes)
        kwargs["pretrained_cfg_overlay"] = overlay
    return build_model_with_cfg(
        ConvFirstNet,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(flatten_sequential=True, out_indices=(0, 1, 2, 3, 4)),
        stem_chs=size.stem,
        stages=size.stages,
        **kwargs,
    )


def _load_checkpoint(model: nn.Module, checkpoint_path: str, *args: Any, **kwargs: Any) -> Any:
    """``timm.create_model(name, checkpoint_path=F)`` loads ``F`` into the built model with timm's
    ``load_checkpoint``, which reads it with ``torch.load`` (a text file renamed ``.pth`` fails there with
    a bare ``KeyError``). For a ConvFirstNet the file goes through the package's one reader instead
    (``weights.read_checkpoint``: every format by its first bytes, "not a checkpoint" and the other
    :class:`~convfirstnet.weights.CheckpointError` messages), loaded as timm loads it: EMA weights
    first, strictly (the model is built before the file is read, so pass the file's ``num_classes``).
    Any other model, or a call with timm's own options, keeps timm's loader."""
    if isinstance(model, ConvFirstNet) and not args and not kwargs:
        load_weights(model, checkpoint_path, use_ema=True, strict=True)
        return None
    return _timm_load_checkpoint(model, checkpoint_path, *args, **kwargs)


_timm_load_checkpoint = getattr(timm.models._factory.load_checkpoint, "timm_load_checkpoint",
                                timm.models._factory.load_checkpoint)  # the original, on a re-import too
_load_checkpoint.timm_load_checkpoint = _timm_load_checkpoint  # type: ignore[attr-defined]
timm.models._factory.load_checkpoint = _load_checkpoint  # the name timm.create_model calls


def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 256, 256),  # paper: train at 224, evaluate at 256
        "min_input_size": (3, MIN_INPUT_SIZE, MIN_INPUT_SIZE),
        "pool_size": (8, 8),
        # The paper does not state its eval crop; 0.95 follows timm's recent recipes.
        "crop_pct": 0.95,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stem.conv",
        "classifier": "classifier",
        "custom_load": True,  # timm calls ConvFirstNet.load_pretrained(file): our checks (see _create)
        "paper_ids": "arXiv:2404.03617",
        "license": "apache-2.0",
        **kwargs,
    }


default_cfgs = generate_default_cfgs({name: _cfg() for name in MODEL_NAMES})


@register_model
def convfirstnet_pico(pretrained: bool = False, **kwargs: Any) -> ConvFirstNet:
    """ConvFirstNet-Pico, training form in train mode (``pretrained=True``: the package's weights)."""
    return _create("convfirstnet_pico", pretrained, **kwargs)


@register_model
def convfirstnet_nano(pretrained: bool = False, **kwargs: Any) -> ConvFirstNet:
    """ConvFirstNet-Nano, training form in train mode (``pretrained=True``: the package's weights)."""
    return _create("convfirstnet_nano", pretrained, **kwargs)


@register_model
def convfirstnet_tiny(pretrained: bool = False, **kwargs: Any) -> ConvFirstNet:
    """ConvFirstNet-Tiny, training form in train mode (``pretrained=True``: the package's weights)."""
    return _create("convfirstnet_tiny", pretrained, **kwargs)


@register_model
def convfirstnet_small(pretrained: bool = False, **kwargs: Any) -> ConvFirstNet:
    """ConvFirstNet-Small, training form in train mode (``pretrained=True``: the package's weights)."""
    return _create("convfirstnet_small", pretrained, **kwargs)
