"""Diffusion and flow matching: schedules, samplers and objectives, the denoisers (DiT, U-Net),
a VAE for latent diffusion, and FID; a sibling of the LLM stack on the same trainer and checkpoints."""
