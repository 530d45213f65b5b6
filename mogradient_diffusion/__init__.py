"""mogradient_diffusion: multi-reward DiffusionNFT with MARBLE harmonization on SD3."""
