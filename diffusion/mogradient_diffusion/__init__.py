"""Multi-reward DiffusionNFT, Flow-GRPO and SDPO training of SD3/SD3.5, FLUX.1 and Qwen-Image."""

import logging


def _without_torchvision_notices(record: logging.LogRecord) -> bool:
    """diffusers' SD3 module names two transformers image processors whose default backend
    is torchvision (it does not work with the pinned torch); transformers falls back to
    their PIL versions, which are what we use, and says so on every command."""
    return "requires torchvision (not installed)" not in record.getMessage()


logging.getLogger("transformers.utils.import_utils").addFilter(_without_torchvision_notices)
