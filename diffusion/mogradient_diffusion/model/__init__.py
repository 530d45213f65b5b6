"""The trained model: SD3/SD3.5, FLUX.1 or Qwen-Image with LoRA adapters; tiny offline copies."""
