"""Build the optional C kernels (plain C + AVX2, loaded with ctypes; no torch linkage).

If no C compiler is available the extension is skipped and Sluice falls back to torch ops.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sluice._kernels",
            sources=["src/sluice/kernels/kernels.c", "src/sluice/kernels/runtime.c", "src/sluice/kernels/quant.c",
                     "src/sluice/kernels/quant512.c",
                     "src/sluice/kernels/fp8.c",
                     "src/sluice/kernels/attention.c", "src/sluice/kernels/crc32.c",
                     "src/sluice/kernels/quantize.c", "src/sluice/kernels/norm.c"],
            extra_compile_args=["-O3", "-std=c11", "-fvisibility=hidden", "-pthread", "-fno-strict-aliasing"],
            extra_link_args=["-pthread"],
            depends=["src/sluice/kernels/sk.h", "src/sluice/kernels/quant.h", "src/sluice/kernels/quantize_lanes.h"],
            optional=True,
        )
    ]
)
