"""The one compiled part: draft-file lookups (data/_draft_lookup.c). Optional: without a C compiler the install
still succeeds and data/draft_file.py answers lookups with its numpy reference (~3-8x slower per lookup)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("data._draft_lookup", ["data/_draft_lookup.c"], optional=True,
                             extra_compile_args=["-O2"])])
