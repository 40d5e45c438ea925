# The compiled cffi extension (API mode, built from llama.h at build time): its ffi and lib have
# no static types, every C function and constant is an attribute of ``lib``.
from typing import Any

ffi: Any
lib: Any
