"""A trainer's images (TRL's vision datasets): whether its data has them, the processor and model they need, and what
a trainer refuses with them, each in one sentence. The rows' own processing is sequences/images.py's.

    images = with_images(train_dataset, eval_dataset)
    processing_class = processor_for(processing_class, model, images, trust_remote_code)   before the model loads
    vision = vision_processing(images, processing_class, policy, "SFT", {"packing": why, ...})   after

`images` is the name of the first dataset with images (`with_images`), or None.
"""

from posttrain.configs import ConfigError
from posttrain.sequences.batches import first_row
from posttrain.sequences.images import VisionProcessing, has_image_columns, is_vision_processor


def dataset_has_images(dataset) -> bool:
    """Whether a dataset (or its first row, for a stream) has an `image` or `images` column."""
    if dataset is None:
        return False
    columns = getattr(dataset, "column_names", None)
    return has_image_columns(columns if columns is not None else first_row(dataset))


def with_images(train_dataset, eval_dataset) -> str | None:
    """The name of the first of a trainer's datasets with images ("train_dataset", "eval_dataset" or
    "eval_dataset['name']" of a dict of them), or None when none has any."""
    if dataset_has_images(train_dataset):
        return "train_dataset"
    named = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
    for key, dataset in named.items():
        if dataset_has_images(dataset):
            return "eval_dataset" if key is None else f"eval_dataset[{key!r}]"
    return None


def processor_for(processing_class, model, images: str | None, trust_remote_code: bool):
    """The processing class a run with images uses: as given, or, when none is given and the model is a path, the
    checkpoint's processor (AutoProcessor, as TRL loads it)."""
    if not images or processing_class is not None or not isinstance(model, str):
        return processing_class
    from transformers import AutoProcessor

    from posttrain.models.loading import ModelLoadError, hub_reachable_or_cached

    hub_reachable_or_cached(model, "processor")
    try:
        return AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise ModelLoadError(f"Could not load a processor from {model!r}: {err}") from err


def layout_refusals(args) -> dict[str, str]:
    """The batch layouts a dataset with images cannot run with, as TRL refuses them (packing and padding-free rows,
    keep_end's cut through the prompt), each with its fix; for vision_processing's `refused`."""
    refused = {}
    if getattr(args, "packing", False):
        refused["packing=True"] = "set packing=False (a row's image tokens and its pixels stay together)"
    if getattr(args, "padding_free", False):
        refused["padding_free=True"] = "set padding_free=False (each row's pixels go with its own row)"
    if getattr(args, "max_length", None) is not None and getattr(args, "truncation_mode", None) == "keep_end":
        refused["truncation_mode='keep_end'"] = ("the images' tokens sit in the prompt, which keep_end may cut; use "
                                                 "truncation_mode='keep_start' or max_length=None")
    return refused


def vision_processing(images: str | None, processing_class, model, title: str, refused: dict[str, str]) -> \
        VisionProcessing | None:
    """The rows' processing for a dataset with images (`images`: its name, from `with_images`; None: no dataset has
    any): the processor must be a vision-language model's and the model one too; `refused` maps each option set
    that cannot carry images to its fix."""
    if not images:
        return None
    from posttrain.models.checkpoint_classes import is_vision_language

    if not is_vision_processor(processing_class) or not is_vision_language(model):
        what = (f"the processing class is a {type(processing_class).__name__}, not a processor with an image "
                "processor" if not is_vision_processor(processing_class) else
                f"the model is a {type(model).__name__}, not a vision-language model")
        raise ConfigError(f"{title}'s {images} has images (an 'image' or 'images' column), but {what}: train a "
                          "vision-language checkpoint with its processor (AutoProcessor.from_pretrained), or remove "
                          "the image column to train on the text.")
    for option, fix in refused.items():
        raise ConfigError(f"{option} is not supported with images ({images} has an 'image' or 'images' column): "
                          f"{fix}.")
    return VisionProcessing(processing_class)
