"""Fourier transforms as DFT contractions (frontend/ops_fft.py) and complex values (ops_complex.py) on the reference
and gpu targets: every transform (full, one-sided, real inverse; padded and truncated), direction and norm, and
complex products, sums, conjugates and magnitudes, against torch on inputs other than the compile's examples; ATen's
forms (AOTAutograd's `_fft_c2c` on a tensor made complex, `view_as_complex` of a gradient); an FNet-style token mixer
and an FFT convolution trained through the backend with no fallback; and the refusals, each naming its problem."""

import pytest
import torch

import stitchflow
from stitchflow import backend
from stitchflow.ir.errors import UnsupportedOpError
from conftest import assert_close, skip_unless_kernels_run, twins

aten = torch.ops.aten

CASES = {
    "fftn_real": lambda x: torch.fft.fftn(x, dim=(1, 2)).real * 2,
    "fft_imag_plus_fft2_real": lambda x: torch.fft.fft(x).imag + torch.real(torch.fft.fft2(x)),
    "ifft_ortho": lambda x: torch.fft.ifft(x, dim=1, norm="ortho").real,
    "fftn_all_forward_norm": lambda x: torch.fft.fftn(x, norm="forward").imag,
    "ifftn_of_fftn": lambda x: torch.fft.ifftn(torch.fft.fftn(x, dim=(0, 2)), dim=(0, 2)).real,
    "view_as_real": lambda x: torch.view_as_real(torch.fft.fft(x, dim=0)).flatten(-2),
    "real_of_a_real_tensor": lambda x: x.real + 1,
    "rfft_padded_magnitude": lambda x: torch.fft.rfft(x, n=16).abs(),
    "rfft_truncated": lambda x: torch.fft.rfft(x, n=6, dim=1).imag,
    "irfft_of_rfft_odd": lambda x: torch.fft.irfft(torch.fft.rfft(x), n=x.shape[-1]),
    "irfft_default_length": lambda x: torch.fft.irfft(torch.fft.rfft(x, dim=1), dim=1),
    "irfft2_of_scaled_rfft2": lambda x: torch.fft.irfft2(torch.fft.rfft2(x) * 2, s=x.shape[-2:]),
    "rfftn_ortho": lambda x: torch.fft.rfftn(x, norm="ortho").imag,
    "centred_spectrum": lambda x: torch.fft.fftshift(torch.fft.fft2(x)).abs() + torch.fft.ifftshift(x, dim=1),
    "fft_padded": lambda x: torch.fft.fft(x, n=9, dim=1).real,
    "complex_sums": lambda x: (torch.fft.fft(x) - torch.fft.fft(x * 2) + 1.5).imag + (torch.fft.fft(x) + x).real,
    "correlation_by_conj": lambda x: torch.fft.irfft(torch.fft.rfft(x, dim=1) * torch.conj(torch.fft.rfft(x.flip(1),
                                                     dim=1)), n=x.shape[1], dim=1),
}


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_transforms_equal_torch_fft(name, dtype, target):
    skip_unless_kernels_run(target)
    g = torch.Generator().manual_seed(len(name))
    example, x = (torch.randn(3, 12, 7, generator=g, dtype=dtype) for _ in range(2))
    prog = stitchflow.compile(CASES[name], (example,), target=target, fusion="auto")
    assert_close(prog(x), CASES[name](x))


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("forward", [True, False])
def test_atens_complex_transform_matches_every_normalization(mode, forward):
    def f(t):
        z = aten._fft_c2c(aten.view_as_complex(t), [0, 1], mode, forward)
        return aten.view_as_real(z)

    g = torch.Generator().manual_seed(mode)
    t, example = torch.randn(6, 5, 2, generator=g), torch.randn(6, 5, 2, generator=g)
    assert_close(stitchflow.compile(f, (example,))(t), f(t))


def test_an_fnet_mixer_trains_through_the_backend(fresh_dynamo):
    """AOTAutograd's forward makes the input complex (`_to_copy`) and transforms it; its backward transforms the
    gradient made complex (`view_as_complex`): both compile."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())

    def step(model, x):
        mixed = torch.fft.fftn(model(x), dim=(1, 2)).real
        return torch.nn.functional.layer_norm(mixed + x, (8,)).square().sum()

    x = torch.randn(2, 10, 8)
    step(torch.compile(layer, backend="stitchflow"), x)  # warm: the compiled module's own call
    ours = torch.compile(lambda x: step(layer, x), backend="stitchflow")
    ours(x).backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    step(layer, x).backward()
    for got, want in zip(grads, (p.grad for p in layer.parameters())):
        assert_close(got, want)
    assert not backend.FALLBACKS, backend.fallback_report()


def fft_convolution(u, k):
    """A long convolution by FFT (Hyena's, FlashFFTConv's): zero-padded to twice the length, multiplied, cut."""
    length = u.shape[-1]
    spectrum = torch.fft.rfft(u, n=2 * length) * torch.fft.rfft(k, n=2 * length)
    return torch.fft.irfft(spectrum, n=2 * length)[..., :length]


def test_an_fft_convolution_trains_through_the_backend(fresh_dynamo):
    """AOTAutograd's _fft_r2c and _fft_c2r, forward and backward."""
    g = torch.Generator().manual_seed(2)
    u, k = torch.randn(2, 4, 33, generator=g), torch.randn(4, 33, generator=g)
    grads = []
    for fn in (torch.compile(fft_convolution, backend="stitchflow"), fft_convolution):
        a, b = u.clone().requires_grad_(), k.clone().requires_grad_()
        out = fn(a, b)
        (out * torch.linspace(-1, 1, 33)).square().sum().backward()
        grads.append((out.detach(), a.grad, b.grad))
    for ours, theirs in zip(*grads):
        assert_close(ours, theirs)
    assert not backend.FALLBACKS, backend.fallback_report()


class SpectralConv2d(torch.nn.Module):
    """A Fourier neural operator's layer: the lowest modes of the input's spectrum mixed across channels by complex
    weights (complex einsums), written into a spectrum of zeros, transformed back."""

    def __init__(self, cin: int, cout: int, modes: int):
        super().__init__()
        self.modes, self.cout = modes, cout
        self.w1 = torch.nn.Parameter(torch.rand(cin, cout, modes, modes, dtype=torch.cfloat) / (cin * cout))
        self.w2 = torch.nn.Parameter(torch.rand(cin, cout, modes, modes, dtype=torch.cfloat) / (cin * cout))

    def forward(self, x):
        b, _, h, w = x.shape
        m = self.modes
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(b, self.cout, h, w // 2 + 1, dtype=torch.cfloat)
        out_ft[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], self.w1)
        out_ft[:, :, -m:, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m:, :m], self.w2)
        return torch.fft.irfft2(out_ft, s=(h, w))


class FourierBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.spectral, self.pointwise = SpectralConv2d(4, 4, 3), torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return torch.nn.functional.gelu(self.spectral(x) + self.pointwise(x))


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_a_fourier_neural_operator_block_compiles_whole(train, fresh_dynamo):
    """Complex parameters, a complex factory, complex einsums, item assignment into a complex spectrum: no
    fallback, forward or backward."""
    ours, theirs = twins(FourierBlock)
    x = torch.randn(2, 4, 10, 12)
    with torch.set_grad_enabled(train):
        out = torch.compile(ours, backend="stitchflow")(x)
        ref = theirs(x)
    assert_close(out, ref)
    if train:
        out.square().sum().backward()
        ref.square().sum().backward()
        for got, want in zip(ours.parameters(), theirs.parameters()):
            assert_close(torch.view_as_real(got.grad) if got.grad.is_complex() else got.grad,
                         torch.view_as_real(want.grad) if want.grad.is_complex() else want.grad)
    assert not backend.FALLBACKS, backend.fallback_report()


STFTS = {
    "hann_magnitude": lambda x: torch.stft(x, 16, hop_length=4, window=torch.hann_window(16),
                                           return_complex=True).abs(),
    "short_window": lambda x: torch.stft(x, 16, hop_length=5, win_length=10, window=torch.hamming_window(10),
                                         return_complex=True).real,
    "uncentred_normalized": lambda x: torch.stft(x, 12, hop_length=3, center=False, normalized=True,
                                                 window=torch.ones(12), return_complex=True).imag,
    "one_dimensional_power": lambda x: torch.stft(x[0], 8, window=torch.hann_window(8),
                                                  return_complex=True).abs() ** 2,
    "two_sided": lambda x: torch.stft(x, 8, onesided=False, window=torch.hann_window(8), return_complex=True).real,
}


HANN = torch.hann_window(16)
ISTFTS = {
    "round_trip": lambda x: torch.istft(torch.stft(x, 16, hop_length=4, window=HANN, return_complex=True), 16,
                                        hop_length=4, window=HANN),
    "scaled_to_a_length": lambda x: torch.istft(2 * torch.stft(x, 16, hop_length=4, window=HANN, return_complex=True),
                                                16, hop_length=4, window=HANN, length=90),
    "short_window": lambda x: torch.istft(torch.stft(x, 16, hop_length=4, win_length=12, window=torch.hann_window(12),
                                                     return_complex=True), 16, hop_length=4, win_length=12,
                                          window=torch.hann_window(12)),
    "uncentred_rectangular": lambda x: torch.istft(torch.stft(x[0], 16, hop_length=4, window=torch.ones(16),
                                                              center=False, return_complex=True), 16, hop_length=4,
                                                   window=torch.ones(16), center=False),
}


@pytest.mark.parametrize("target", ["reference", "gpu"])
@pytest.mark.parametrize("name", sorted(STFTS) + sorted(ISTFTS))
def test_short_time_transforms_and_inverses_equal_torch(name, target):
    skip_unless_kernels_run(target)
    fn = STFTS.get(name) or ISTFTS[name]
    g = torch.Generator().manual_seed(len(name))
    example, x = (torch.randn(2, 100, generator=g) for _ in range(2))
    prog = stitchflow.compile(fn, (example,), target=target, fusion="auto")
    assert_close(prog(x), fn(x))


class SpectralMask(torch.nn.Module):
    """Speech enhancement by a learned gain per frequency: stft, a gain from the magnitudes, istft."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Linear(9, 9)
        self.register_buffer("window", torch.hann_window(16))

    def forward(self, audio):
        spectrum = torch.stft(audio, 16, hop_length=4, window=self.window, return_complex=True)
        gain = torch.sigmoid(self.gain(spectrum.abs().transpose(-1, -2))).transpose(-1, -2)
        return torch.istft(spectrum * gain, 16, hop_length=4, window=self.window, length=audio.shape[-1])


def test_a_spectral_mask_trains_through_the_backend(fresh_dynamo):
    ours, theirs = twins(SpectralMask)
    audio = torch.randn(2, 100)
    out, ref = torch.compile(ours, backend="stitchflow")(audio), theirs(audio)
    assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert_close(ours.gain.weight.grad, theirs.gain.weight.grad)
    assert not backend.FALLBACKS, backend.fallback_report()


def test_a_log_mel_spectrogram_compiles_whole(fresh_dynamo):
    """An audio front end (Whisper's features): stft, power, a mel filter bank as a matrix, log."""
    mel = torch.rand(10, 33)

    def features(audio):
        power = torch.stft(audio, 64, hop_length=16, window=torch.hann_window(64), return_complex=True).abs() ** 2
        return torch.log10(torch.clamp(mel @ power, min=1e-10))

    audio = torch.randn(2, 400)
    assert_close(torch.compile(features, backend="stitchflow")(audio), features(audio))
    assert not backend.FALLBACKS, backend.fallback_report()


def test_complex_inputs_parameters_and_outputs_pass_as_pairs(fresh_dynamo):
    """A complex tensor enters a program as view_as_real's real tensor and leaves as a complex one again."""
    w = torch.randn(6, 5, dtype=torch.complex64)

    def f(x, z):
        return torch.fft.fft(x) * z.conj() + w[:, 1], (z * 2).real

    x, z = torch.randn(4, 6), torch.randn(4, 6, dtype=torch.complex64)
    ours, theirs = torch.compile(f, backend="stitchflow")(x, z), f(x, z)
    assert ours[0].dtype == torch.complex64
    assert_close(torch.view_as_real(ours[0]), torch.view_as_real(theirs[0]))
    assert_close(ours[1], theirs[1])
    assert not backend.FALLBACKS, backend.fallback_report()


def test_a_complex_value_anywhere_else_is_refused_with_the_reason(fresh_dynamo):
    x = torch.randn(4, 6)
    out = torch.compile(lambda x: torch.fft.fft(x).logcumsumexp(-1).real, backend="stitchflow")(x)
    assert_close(out, torch.fft.fft(x).logcumsumexp(-1).real)
    assert "takes or makes a complex value" in backend.fallback_report()

    with pytest.raises(UnsupportedOpError, match="transform of length 8192"):
        stitchflow.compile(lambda x: torch.fft.rfft(x, n=8192).real, (x,))
    with pytest.raises(UnsupportedOpError, match="float32 or float64"):
        stitchflow.compile(lambda x: torch.fft.fft(x).real, (x.to(torch.int64),))
