"""A trainer's images (TRL's vision datasets): whether its data has them, the processor and model they need, and what
a trainer refuses with them, each in one sentence. The rows' own processing is sequences/images.py's.

    processing_class = processor_for(processing_class, model, images, trust_remote_code)   before the model loads
    vision = vision_processing(images, processing_class, policy, "SFT", {"packing": why, ...})   after
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


def named_datasets(eval_dataset) -> list:
    """An eval_dataset (one, a dict of them, or None) as a list of datasets."""
    if eval_dataset is None:
        return []
    return list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]


def processor_for(processing_class, model, images: bool, trust_remote_code: bool):
    """The processing class a run with images uses: as given, or, when none is given and the model is a path, the
    checkpoint's processor (AutoProcessor, as TRL loads it)."""
    if not images or processing_class is not None or not isinstance(model, str):
        return processing_class
    from posttrain.models.loading import load_processor

    return load_processor(model, trust_remote_code)


def vision_processing(images: bool, processing_class, model, title: str, refused: dict[str, str]) -> \
        VisionProcessing | None:
    """The rows' processing for a dataset with images (None without): the processor must be a vision-language
    model's and the model one too; `refused` maps each option set that cannot carry images to its fix."""
    if not images:
        return None
    from posttrain.models.checkpoint_classes import is_vision_language

    if not is_vision_processor(processing_class) or not is_vision_language(model):
        what = (f"the processing class is a {type(processing_class).__name__}, not a processor with an image "
                "processor" if not is_vision_processor(processing_class) else
                f"the model is a {type(model).__name__}, not a vision-language model")
        raise ConfigError(f"The {title} dataset has images (an 'image' or 'images' column), but {what}: train a "
                          "vision-language checkpoint with its processor (AutoProcessor.from_pretrained), or remove "
                          "the image column to train on the text.")
    for option, fix in refused.items():
        raise ConfigError(f"{option} is not supported with images (the dataset has an 'image' or 'images' column): "
                          f"{fix}.")
    return VisionProcessing(processing_class)
