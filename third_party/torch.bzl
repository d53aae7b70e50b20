"""Compile options for code that includes LibTorch's C++ API (torch/torch.h).

Debian keeps that API below /usr/include/torch/csrc/api/include. A cc_library's copts do not
reach its dependents, so every target that includes torch headers adds TORCH_COPTS itself.
"""

TORCH_COPTS = ["-isystem", "/usr/include/torch/csrc/api/include"]
