"""The thresholds of the neuron taxonomy: one frozen dataclass, each field with its source.

Activation thresholds must be edges of the atlas histogram (:data:`kvmem.scanning.bins.MAGNITUDE_EDGES`,
2^e and 1.5·2^e), so that a count above them is a sum of whole bins and exact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from kvmem.errors import KvmemError
from kvmem.scanning.bins import MAGNITUDE_EDGES

__all__ = ["THRESHOLD_SOURCES", "Thresholds"]

# field -> where its value comes from (recorded beside the table)
THRESHOLD_SOURCES: dict[str, str] = {
    "kurtosis": "Gurnee et al. 2024 (arXiv 2401.12181): prediction / suppression neurons are those with "
                "vocab_kurt > 10, split by the sign of the skew (their released code, "
                "analysis/prediction_neurons.py, query('vocab_kurt > 10'))",
    "null_space_fraction_of_d_model": "Stolfo et al. 2024 (Confidence regulation neurons, arXiv 2406.16254): "
                                      "the null space is the span of W_U's k smallest singular directions, "
                                      "k = 40 ≈ 0.01·d_model for Llama-2 7B; kvmem takes k = max(1, round(0.01·d_model))",
    "entropy_null_fraction": "kvmem's choice: a candidate entropy neuron keeps at least this share of ‖v‖² in the "
                             "null space (Stolfo et al. show such neurons as outliers of this share, no cut-off)",
    "entropy_norm_quantile": "kvmem's choice: a candidate's ‖v‖ is at or above this quantile of its layer",
    "weak_edge": "kvmem's choice: the smallest finite histogram edge, 2^-7; |m| below it is not resolved by the bins",
    "active_edge": "kvmem's choice: a histogram edge; freq_active counts |m| >= it",
    "strong_edge": "kvmem's choice: a histogram edge; freq_strong counts |m| >= it",
    "rare_frequency": "kvmem's choice: a neuron that is not dead but has freq_active below this is rare",
    "positional_correlation": "kvmem's choice: |Pearson r of m with the position in the window| at or above this "
                              "flags a positional neuron (Voita et al. 2024 describe positional neurons, no cut-off "
                              "on r; a range indicator that fires mid-window has a small r)",
    "unigram_alignment": "kvmem's choice: |r of W_U^T v with the log unigram frequency| at or above this flags a "
                         "token-frequency neuron (Stolfo et al. 2024 describe the effect, no cut-off)",
    "unigram_min_count": "kvmem's choice: the log-frequency direction is over the tokens the corpus holds at least "
                         "this many times (log 0 is undefined; Stolfo et al. use a training-corpus unigram distribution)",
}


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Cut-offs of the taxonomy's flags (sources in :data:`THRESHOLD_SOURCES`).

    kurtosis:   prediction = excess kurtosis > kurtosis and skew > 0; suppression: skew < 0
    null_space_fraction_of_d_model: k = max(1, round(this · d_model)) smallest singular directions of W_U
    entropy_null_fraction, entropy_norm_quantile: the entropy-candidate flag
    weak_edge:  dead = no position with |m| >= weak_edge
    active_edge, strong_edge: the edges of freq_active and freq_strong
    rare_frequency: rare = not dead and freq_active < rare_frequency
    positional_correlation: positional = |position_correlation| >= this
    unigram_alignment: token_frequency = |unigram_alignment| >= this
    unigram_min_count: the log-frequency direction's tokens: those counted at least this often
    """

    kurtosis: float = 10.0
    null_space_fraction_of_d_model: float = 0.01
    entropy_null_fraction: float = 0.25
    entropy_norm_quantile: float = 0.99
    weak_edge: float = 2.0 ** -7
    active_edge: float = 2.0 ** -3
    strong_edge: float = 1.0
    rare_frequency: float = 1e-3
    positional_correlation: float = 0.5
    unigram_alignment: float = 0.5
    unigram_min_count: int = 1

    def __post_init__(self):
        for name in ("weak_edge", "active_edge", "strong_edge"):
            value = getattr(self, name)
            if value not in MAGNITUDE_EDGES:
                allowed = ", ".join(f"{e:g}" for e in MAGNITUDE_EDGES)
                raise KvmemError(f"threshold {name}={value!r} is not a histogram edge, so counts above it would "
                                 f"not be exact; choose one of {allowed}")
        if not self.weak_edge <= self.active_edge <= self.strong_edge:
            raise KvmemError(f"need weak_edge <= active_edge <= strong_edge, got {self.weak_edge}, "
                             f"{self.active_edge}, {self.strong_edge}")
        for name in ("null_space_fraction_of_d_model", "entropy_null_fraction", "entropy_norm_quantile",
                     "rare_frequency", "positional_correlation", "unigram_alignment"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise KvmemError(f"threshold {name} must lie in (0, 1), got {value!r}")
        if isinstance(self.unigram_min_count, bool) or not isinstance(self.unigram_min_count, int) \
                or self.unigram_min_count < 1:
            raise KvmemError(f"threshold unigram_min_count must be an integer >= 1, got {self.unigram_min_count!r}")
        if not self.kurtosis > 0:
            raise KvmemError(f"threshold kurtosis must be positive, got {self.kurtosis!r}")

    def null_space_dim(self, d_model: int) -> int:
        """k, the number of W_U's smallest singular directions spanning the null space."""
        return max(1, round(self.null_space_fraction_of_d_model * d_model))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Thresholds:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise KvmemError(f"unknown taxonomy thresholds {unknown}; known ones are {', '.join(sorted(known))}")
        return cls(**data)
