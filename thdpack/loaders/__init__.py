"""A plan in a DataLoader: the batch sampler, the streaming packer and the collators."""
