"""Models: the built-in denoiser, the loaders for a user's own model files, preprocessing and what an output is.

Used by the main process (load once, share the weights), the workers (build the module, run it) and the front ends
(preprocessing, output kinds). May import only the shared top-level modules.
"""
