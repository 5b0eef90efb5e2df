

def test_avx512_tile_matches_avx2():
    """Where the CPU has AVX-512F the tiled product runs on it: the same bits as the AVX2 tile
    and as one row at a time (CI hosts without it run the AVX2 tile in the tests above)."""
    if not kernels.allow_avx512(True):
        assert kernels.info()["avx512"] is False  # nothing to compare on this host
        return
    g = gen(13)
    for dtype in DTYPES:
        for n, k in ((45, 67), (64, 512)):
            x = torch.randn(50, k, generator=g)
            w = torch.randn(n, k, generator=g).to(dtype)
            wide = linear(x, w)
            try:
                kernels.allow_avx512(False)
                narrow = linear(x, w)
            finally:
                kernels.allow_avx512(True)
            one = torch.cat([linear(x[i : i + 1], w) for i in range(50)])
            assert torch.equal(wide, narrow) and torch.equal(wide, one), (dtype, n, k)
