"""Train a ConvFirstNet with the paper's ImageNet recipe (Section 6.3), built from timm's components.

    torchrun --nproc_per_node 8 scripts/train_imagenet.py --model pico --data /data/imagenet \
        --output out/pico
    convfirstnet train --model pico --data /data/imagenet --output out/pico --resume auto   # after a stop

Recipe defaults (paper 6.3, which trained with timm on 8 GPUs x 256 images), flags in brackets:

- 600 epochs [--epochs]; global batch 2048 at lr 0.128, the lr scaled linearly with the global batch
  [--batch-size per process, --lr-base, --lr absolute];
- 3 warm-up epochs [--warmup-epochs], then step decay 0.97 every 2.4 epochs (timm ``step`` scheduler,
  stepped per update) [--decay-epochs, --decay-rate];
- RMSprop with TensorFlow-style epsilon (timm ``rmsproptf``), momentum 0.9, weight decay 1e-5
  [--opt, --momentum, --weight-decay];
- dropout 0.2 Pico / 0.3 others (``SIZES[size].drop_rate``) [--drop], drop-path 0.2 [--drop-path];
- RandAugment ``rand-m9-mstd0.5`` [--aa], random erasing 0.2 in "pixel" mode [--reprob, --remode];
  ``--aug none`` turns all augmentation off;
- EMA of the weights, timm ``ModelEmaV3`` with decay 0.9999 [--ema-decay, --no-ema];
- fp16 autocast + GradScaler on CUDA [--no-amp], channels-last [--no-channels-last];
- on CUDA the ConvFirst blocks run the fused training kernels (``convfirstnet.training_kernels``: Triton
  forward and backward, BatchNorm with batch statistics, the wide activation recomputed, the same
  state_dict), the other blocks their layers [--kernels torch: every layer in PyTorch];
- training at 224x224 [--img-size], evaluation at the model's ``pretrained_cfg`` size, 256 with
  crop_pct 0.95 [--val-img-size].

Not stated by the paper, taken from timm's EfficientNet recipe (which the paper says inspired its
settings): ``--opt-eps 1e-3``, ``--smoothing 0.1`` (timm ``train.py``'s default), ``--warmup-lr 1e-6``.

Mixup / CutMix: timm's ``Mixup`` with ``SoftTargetCrossEntropy``, off by default (the paper's recipe has
none) [--mixup, --cutmix, --cutmix-minmax, --mixup-prob, --mixup-switch-prob, --mixup-mode,
--mixup-off-epoch], the flags of timm's ``train.py``.

Fine-tuning: ``--pretrained`` (the model's weights, looked up as ``pretrained=True`` does) or
``--initial-checkpoint PATH`` (a weight file or timm checkpoint, EMA weights preferred as in timm), with
``--num-classes`` (default: the training folder's class count); a classifier of another size starts
from its initialisation.

Data: an ImageFolder tree with ``train/`` and ``val/`` (or ``validation/``) class folders (timm
``create_dataset``; ``--train-split`` / ``--val-split`` name other folders). Both must exist: a folder
without them is refused rather than trained and validated on the same images. Several GPUs or nodes:
``torchrun`` (DDP; nccl on CUDA, gloo on CPU).

Output folder: ``last.pth.tar`` (every epoch), ``checkpoint-<epoch>.pth.tar`` (best few by top-1),
``recovery-<epoch>-<step>.pth.tar`` (every ``--recovery-interval`` steps and when ``--max-steps`` stops
the run; removed at the next epoch checkpoint), ``summary.csv`` (timm's columns: ``epoch, train_loss,
eval_loss, eval_top1, eval_top5``, the EMA's ``eval_ema_loss, eval_ema_top1, eval_ema_top5``, ``lr``; one
row per epoch), ``log.jsonl`` (loss, lr, img/s, validation metrics), ``args.yaml`` (as timm's), and at
the end ``<model_name>.safetensors``: the EMA weights, written by ``convert_checkpoint`` and ready for
``create_model(name, pretrained=True)`` via ``$CONVFIRSTNET_WEIGHTS_DIR``. A checkpoint holds the model, EMA,
optimizer, GradScaler and scheduler
states and the position (epoch, step in the epoch, global step); ``--resume auto`` continues from the
most advanced one, mid-epoch included, with the same sample order. Every input is checked before the
output folder is created; a run that fails before its first checkpoint removes what it created. An
output folder that holds an earlier run (any of the files above) is refused unless ``--resume`` continues
it or ``--overwrite`` starts over, which first removes exactly those files (other files stay).

The command's modules: ``options`` (flags, recipe defaults and their checks), ``data`` (folders,
labels, transforms, the resumable sampler, loaders), ``checkpoints`` (initial weights, resume,
timm's CheckpointSaver, the weight file), ``output`` (the output folder: run files, log, summary),
``prepare`` (everything built and checked before the output folder exists), ``loop`` (epochs, steps,
validation) and ``command`` (the run and its clean-up).
"""

from .command import main, train
from .options import build_parser, recipe_lr

__all__ = ["build_parser", "main", "recipe_lr", "train"]
