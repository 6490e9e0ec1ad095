"""Build hook for the optional compiled convolution kernels (metadata lives in setup.cfg).

``optional=True``: where no C compiler is available the build goes on without the extension and
``lbannpy.layers.kernels.conv`` uses its NumPy path."""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "lbannpy.layers.kernels._cconv", ["layers/kernels/_cconv.c"], depends=["layers/kernels/_cconv_impl.h"],
    extra_compile_args=["-O3", "-ffp-contract=fast", "-Wno-psabi"], optional=True)])
