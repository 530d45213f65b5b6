"""The trained model: Stable Diffusion 3 with LoRA adapters, and a tiny offline copy."""
