"""Building blocks shared by the model families: rotary embeddings and friends."""
