"""The compiled parts: draft-file lookups (data/_draft_lookup.c) and the CPU decode attention
(inference/_cpu_kernels.c). Both optional: without a C compiler the install still succeeds, draft-file lookups
run on data/draft_file.py's numpy reference (~3-8x slower per lookup) and decoding on MatmulAttention's GEMMs."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("data._draft_lookup", ["data/_draft_lookup.c"], optional=True, extra_compile_args=["-O2"]),
    # -ffp-contract=off: no fused multiply-adds, so the kernel's avx2 and default clones round alike
    Extension("inference._cpu_kernels", ["inference/_cpu_kernels.c"], optional=True,
              extra_compile_args=["-O3", "-ffp-contract=off", "-Wno-psabi"]),
])
