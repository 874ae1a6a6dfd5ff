"""Models: the built-in denoiser and loaders for a user's own TorchScript, torch.export or state-dict model."""
