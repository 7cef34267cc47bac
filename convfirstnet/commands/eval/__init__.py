"""ImageNet validation of ConvFirstNets: exact top-1 / top-5, loss, ImageNet-ReaL, and throughput.

    convfirstnet eval --model pico --data /data/imagenet --checkpoint convfirstnet_pico.safetensors
    convfirstnet eval --model all --data /data/imagenet --results-file all.csv
    torchrun --nproc_per_node=8 scripts/eval_imagenet.py --model small --data /data/imagenet

Data: an ImageFolder tree, ``DIR`` itself or its ``val`` / ``validation`` subfolder, one folder per class.
Labels, as timm's ``validate.py`` gives them: with ``--class-map FILE`` (timm's format: a ``.txt`` with
one class name per line, the line number being its index, or a ``.pkl`` dict) the map's indices; else,
when every folder is an ImageNet-1k synset (``n01440764``, ...) and the checkpoint has 1000 classes, the
synset's ImageNet-1k index (``timm.data.ImageNetInfo``), so a subset of the synset folders evaluates as
it is; else the folder's position in timm's sorted order, which needs exactly as many folders as the
checkpoint has classes. Preprocessing is timm's evaluation pipeline from the model's ``pretrained_cfg``
(resize to ``img_size / crop_pct``, center crop, bicubic, ImageNet mean/std, normalised on the device),
so the same weights give the same numbers there.

Weights: a safetensors weight file, or a timm training checkpoint, whose raw weights (``state_dict``)
are taken unless ``--use-ema`` asks for its EMA weights (``state_dict_ema``), as in timm. Without
``--checkpoint`` the weights are looked up as ``pretrained=True`` does.

Counting is exact: integer hit counts and a float64 loss sum, no averaging of per-batch percentages.
Under torchrun each process takes every ``world_size``-th image (``DistributedSampler``, no shuffle);
the sampler pads the shards to equal length by repeating images, and those repeats are skipped, so the
counts and the metrics equal a single process's.

The command's modules: ``options`` (flags and their checks), ``data`` (data folder, labels, dataset,
loader), ``jobs`` (the models and their weights), ``loop`` (exact counting, over one or several
processes), ``output`` (results, predictions, the printed summary) and ``command`` (the run).
"""

from .command import main, run
from .options import build_parser

__all__ = ["build_parser", "main", "run"]
