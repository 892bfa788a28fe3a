"""Model definitions: configurations read from checkpoints, the decoder forward pass, weights."""
