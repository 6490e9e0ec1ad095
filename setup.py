"""Build hook for the optional compiled kernels (metadata lives in setup.cfg).

``optional=True``: where no C compiler is available the build goes on without the extensions;
``lbannpy.layers.kernels.conv`` and ``lbannpy.layers.kernels.batchnorm`` then use their NumPy paths."""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("lbannpy.layers.kernels._cconv", ["layers/kernels/_cconv.c"],
              depends=["layers/kernels/_cconv_impl.h"],
              extra_compile_args=["-O3", "-ffp-contract=fast", "-Wno-psabi"], optional=True),
    Extension("lbannpy.layers.kernels._csmall", ["layers/kernels/_csmall.c"],
              extra_compile_args=["-O3"], optional=True),
    Extension("lbannpy.layers.kernels._conv1c", ["layers/kernels/_conv1c.c"],
              extra_compile_args=["-O3", "-ffp-contract=fast", "-Wno-psabi"], optional=True),
    # no contraction: the affine steps round as NumPy's separate multiply and add do
    Extension("lbannpy.layers.kernels._cbn", ["layers/kernels/_cbn.c"],
              extra_compile_args=["-O3", "-ffp-contract=off"], optional=True),
])
