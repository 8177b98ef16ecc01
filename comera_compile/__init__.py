"""comera-compile: a torch.compile backend for tensor-compressed training."""

from comera_compile._layout import install_checkout_finder as _install_checkout_finder

_install_checkout_finder()
