"""Ops (torch.library) and their Triton kernels, each beside its torch reference."""
