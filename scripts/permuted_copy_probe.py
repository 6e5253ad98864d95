"""Device probe: how fast torch copies a permuted bf16 tensor whose innermost dim stays contiguous (attention's
head splits and merges: (h, s, d) <-> (s, h, d)), as bf16 elements and reinterpreted as wider words (int32,
int64, complex128: the same bytes in 2-8 times fewer elements). Not a test.

    python scripts/permuted_copy_probe.py
"""
import torch

from stitchflow.targets.gpu.timing import timed_median


def main():
    for shape, perm in (((32, 2048, 128), (1, 0, 2)), ((8, 4, 2048, 128), (2, 0, 1, 3)), ((8, 2048, 128), (1, 0, 2))):
        src = torch.randn(shape, device="cuda", dtype=torch.bfloat16).permute(perm)
        ref = src.contiguous()
        mb = 2 * src.numel() * 2 / 1e6
        for label, wide in (("bf16", torch.bfloat16), ("int32", torch.int32), ("int64", torch.int64),
                            ("complex128", torch.complex128)):
            view = src.view(wide) if wide != torch.bfloat16 else src
            assert torch.equal(view.contiguous().view(torch.bfloat16), ref)
            t = timed_median(lambda: view.contiguous()) * 1e6
            print(f"{shape} permuted {perm} as {label}: {t:.1f} us ({mb / t:.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
