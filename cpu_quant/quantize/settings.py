"""What a quantization run is asked to do (:class:`QuantSettings`) and what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import CpuQuantError

METHODS = ("gptq", "rtn")
DEFAULT_RANK_TIMEOUT = 1800.0  # a distributed rank's wait for the others, in seconds (gloo's default)


@dataclass
class QuantSettings:
    method: str = "gptq"
    group_size: int = 128
    scale_search: bool = True
    act_order: bool = True  # static groups: the saved layout is the same either way
    damp: float = 0.01
    quantize_head: bool = True
    head_group: int | None = None  # None: plan.head_group's default
    down_group: int | None = None  # None: plan.down_group's default
    strict_group: bool = False
    calib: str | None = None  # None = built-in corpus; "none" = data-free (RTN only)
    samples: int = 128
    seqlen: int = 512
    batch_size: int = 8
    # calibration activations on disk between layers (same artifact, less memory, more I/O)
    offload_activations: bool = False
    symmetric: bool = True  # the grid: zero pinned at 8, or a free zero per group
    # symmetric scales >= 0 only: the convention of the phone runtimes' int4 weights
    # (export-phone); the default search may pick a negative scale to use the -8 level
    positive_scales: bool = False
    # GPTQ's Hessians from the int8-per-token activations vLLM's W4A8 kernel multiplies
    w4a8_hessians: bool = False
    # activation smoothing folded into the weights before GPTQ (smooth_fold.py); None: where
    # it applies (smooth_fold.default_smoothing), the gptq command's default
    smooth: bool | None = False
    # a mixture-of-experts model: the routed tokens an expert needs for GPTQ (fewer: the
    # round-to-nearest fallback); None: the widest input of its linears (quantize/experts.py).
    # No command-line option: the moe benchmark sets it to compare the experts' methods.
    expert_min_tokens: int | None = None
    # a vision-language model: the calibration windows that begin with an image
    # (image_calibration.py), and the directory of the images (None: the built-in set)
    image_samples: int = 0
    images: str | None = None

    def validate(self) -> None:
        if self.method not in METHODS:
            raise CpuQuantError(f"--method must be one of {', '.join(METHODS)}")
        if self.method == "gptq" and self.calib == "none":
            raise CpuQuantError("GPTQ needs calibration data; use --method rtn for data-free")
        if self.w4a8_hessians and self.method != "gptq":
            raise CpuQuantError("--w4a8-hessians applies to --method gptq only")
        if self.smooth and self.data_free:
            raise CpuQuantError("--smooth needs calibration data (it measures the activations)")
        if self.positive_scales and not self.symmetric:
            raise CpuQuantError("--positive-scales applies to the symmetric grid only")
        if self.expert_min_tokens is not None and self.expert_min_tokens < 0:
            raise CpuQuantError("expert_min_tokens must be >= 0")
        if self.image_samples < 0:
            raise CpuQuantError(f"--image-samples must be >= 0 (got {self.image_samples})")
        if self.image_samples and self.data_free:
            raise CpuQuantError("--image-samples needs calibration data (--calib none has none)")
        if self.image_samples > self.samples:
            raise CpuQuantError(f"--image-samples {self.image_samples} is more than --samples "
                                f"{self.samples} (the image windows are among the samples)")
        if self.images is not None and not self.image_samples:
            raise CpuQuantError("--images applies with --image-samples N (N > 0)")
        if not 0 < self.damp <= 1:
            raise CpuQuantError("--damp must be in (0, 1]")
        for flag, value, least in (("--samples", self.samples, 1), ("--seqlen", self.seqlen, 2),
                                   ("--batch-size", self.batch_size, 1)):
            if value < least:
                raise CpuQuantError(f"{flag} must be >= {least} (got {value})")

    @property
    def data_free(self) -> bool:
        return self.calib == "none"


@dataclass
class TensorReport:
    name: str
    shape: list[int]
    group_size: int
    weighted_snr_db: float
    damp: float | None = None
    damp_raised: bool = False
    # how GPTQ's Hessian was used when the float32 factorisation failed at every damping step
    # (gptq.prepare_hessian): "float64" (factored in float64, at ``damp``), "rtn" (not even
    # then: round-to-nearest with the weighted scale search, no error compensation);
    # "rtn-few-tokens": an expert the router sent fewer tokens than its widest input, taken by
    # round-to-nearest with the weighted scale search (quantize/experts.py); None when it
    # factored in float32 or no Hessian was used
    gptq_fallback: str | None = None


@dataclass
class QuantReport:
    settings: dict
    layout: str
    tensors: list[TensorReport] = field(default_factory=list)
    layer_seconds: list[float] = field(default_factory=list)
    head_seconds: float = 0.0
    total_seconds: float = 0.0
    calibration_tokens: int = 0
    plan_notes: list[str] = field(default_factory=list)
    bits_per_weight: float = 0.0
    bits_per_weight_on_disk: float = 0.0
    head_quantized: bool = False
    true_sequential_layers: int = 0  # the others: two passes (sequential.py)
    # summed over the layers: "quantize" (GPTQ/RTN and the scale search), "hessians" (XᵀX,
    # true-sequential layers); the rest of layer_seconds is the layer's forward passes and I/O
    phase_seconds: dict[str, float] = field(default_factory=dict)
    fidelity: dict | None = None
    # a distributed run: world size, and each rank's batches, time, collectives and bytes moved
    distributed: dict | None = None
    # --smooth: the folds, the strength chosen for each, and the statistics pass's time
    smoothing: dict | None = None
    # a mixture-of-experts model: every expert's routed token count, the experts that fell
    # back to round-to-nearest and why, the router kept bf16 (quantize/experts.py)
    experts: dict | None = None
    # a vision-language checkpoint: its family, the calibration, the modules kept bf16 and why
    vision_language: dict | None = None
    provenance: dict = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)  # format -> its directory (after commit)
