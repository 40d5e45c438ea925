"""pyllamacpp: llama.cpp's C API, compiled with cffi, and a numpy layer over it."""
__version__ = "0.1.0"
