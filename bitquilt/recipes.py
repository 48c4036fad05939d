"""Recipes: a method name + weight grid + per-module overrides, as one serialisable object.

A method is written `stage+...+solver`, e.g. `gptq`, `awq+rtn`, `quarot+gptq`: every part but
the last names a registered transform or policy stage (`bitquilt.calib.stages`), the last a
solver (`bitquilt.solvers`). Short aliases name the usual combinations (`awq` = `awq+rtn`); an
alias may also end a longer method (`awq+mobiquant` = `awq+mobiroute+mobislice`).

Activations and the KV cache are quantized when `a_bits` / `kv_bits` are below 16 (W4A4KV4:
`Recipe("quarot+gptq", w_bits=4, a_bits=4, kv_bits=4)`); overrides may set `a_bits`, `a_sym`
and `a_clip` per linear as well as the weight grid. Everything is validated when the recipe is
built: names, every option set, and each grid against what the solver's format can hold.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field
from pathlib import PurePath
from typing import Any

from bitquilt.calib.stages import STAGES, Stage
from bitquilt.flag_checks import is_integer, is_number
from bitquilt.formats.ggml_blocks import block_type
from bitquilt.formats.uniform import UniformFormat
from bitquilt.nn.act_quant import ActQuantConfig
from bitquilt.policies.gguf_mix import MIXES, check_mix
from bitquilt.solvers import get_solver
from bitquilt.solvers.base import LayerSpec, Solver
from bitquilt.solvers.mosaic import RESIDUALS
from bitquilt.stages import register_builtins

GGUF_SOLVERS = {"rtn": "gguf_rtn", "gptq": "gguf_gptq"}  # with gguf_type: a solver -> its llama.cpp-block twin
METHOD_ALIASES = {"awq": "awq+rtn", "mxsens": "mx_sens+fold_perm+mxint", "mobiquant": "mobiroute+mobislice"}

WEIGHT_FIELDS = {"bits", "group_size", "sym"}
ACT_FIELDS = {"a_bits": "bits", "a_sym": "sym", "a_clip": "clip_ratio"}  # override field -> ActQuantConfig field


# AWQ's scales, RTN's grid, then block-wise reconstruction: 50 signed-gradient steps per block on 4 windows each
# (docs/methods/reconstruction.md)
RECON_RECIPE: dict[str, Any] = {"method": "awq+rtn", "recon_steps": 50, "stage_options": {"recon": {"batch": 4}}}
# GPTQ's own sweep (act-order, static groups, MSE-searched ranges) with 10x the usual dampening
DAMPED_GPTQ: dict[str, Any] = {"method": "gptq", "options": {"damp": 0.1}}
# What `bitquilt quantize` runs when no --method is given (`Recipe.best` in Python), per weight width: damped GPTQ,
# which beat RTN and AWQ at every width on qwen2.5-1.5b, in perplexity and zero-shot accuracy (docs/accuracy.md).
# Reconstruction is more accurate on a model as small as smollm2-135m, but costs hours on a 1.5B model.
BEST_RECIPES: dict[int, dict[str, Any]] = {
    4: {**DAMPED_GPTQ, "group_size": 128},
    3: {**DAMPED_GPTQ, "group_size": 128},
    2: {**DAMPED_GPTQ, "group_size": 64},
}


def default_recipe(w_bits: int, gguf_type: str | None = None) -> dict[str, Any]:
    """The fields of the CLI's default recipe: `BEST_RECIPES` at `w_bits` ({}: the class defaults at other widths),
    or with a GGUF mix `DAMPED_GPTQ`, whose solver then solves onto llama.cpp's blocks (their size fixes the groups)."""
    return DAMPED_GPTQ if gguf_type is not None else BEST_RECIPES.get(w_bits, {})


def as_flags(recipe: dict[str, Any]) -> str:
    """A `BEST_RECIPES` entry as the `bitquilt quantize` flags that ask for it, e.g.
    "gptq --damp 0.1 --group-size 128"."""
    flags = [recipe["method"]]
    flags += [f"--{key.replace('_', '-')} {value}" for key, value in recipe.get("options", {}).items()]
    if recipe.get("recon_steps"):
        flags.append(f"--recon-steps {recipe['recon_steps']}")
    flags += [f"--opt {stage}.{key}={value}" for stage, opts in recipe.get("stage_options", {}).items()
              for key, value in opts.items()]
    if "group_size" in recipe:
        flags.append(f"--group-size {recipe['group_size']}")
    return " ".join(flags)


def best_recipes_text() -> str:
    """What `bitquilt quantize` runs without --method, per width, e.g. "4 bits: gptq --damp 0.1 --group-size 128"."""
    return "; ".join(f"{bits} bits: {as_flags(recipe)}" for bits, recipe in sorted(BEST_RECIPES.items(), reverse=True))


def expand_method(method: str) -> str:
    """The method with an alias at its end spelled out: "awq" -> "awq+rtn", "awq+mobiquant" ->
    "awq+mobiroute+mobislice"."""
    *before, last = method.split("+")
    return "+".join([*before, METHOD_ALIASES.get(last, last)])


def solver_name(method: str) -> str:
    """The solver a method ends in, e.g. "awq+gptq" -> "gptq", "awq" (= "awq+rtn") -> "rtn"."""
    return expand_method(method).split("+")[-1]


@dataclass(frozen=True)
class CalibConfig:
    """What the statistics were collected on (recorded in saved models)."""

    source: str = "coqa"  # five domains: fits text it was not calibrated on better than narrow SciQ (docs/accuracy.md)
    n_samples: int = 64
    seqlen: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        wrong = [f"{name}={getattr(self, name)!r} (an integer)" for name in ("n_samples", "seqlen", "seed")
                 if not is_integer(getattr(self, name))]
        if not isinstance(self.source, (str, PurePath)):
            wrong.append(f"source={self.source!r} (a text set name or a path)")
        if wrong:
            raise ValueError(f"CalibConfig: {', '.join(wrong)} expected")


HEAD_BITS = (16, 8, 4)  # 16: the head and embeddings stay in full precision


def head_spec(bits: int, group_size: int) -> LayerSpec:
    """The grid of the head and embeddings at `bits` (symmetric at 8, asymmetric at 4); a ValueError listing what is
    accepted otherwise."""
    if bits not in HEAD_BITS:
        raise ValueError(f"head_bits (--head-bits) must be one of {', '.join(map(str, HEAD_BITS))} (16: the LM head "
                         f"and embeddings stay in full precision), got {bits}")
    spec = LayerSpec(bits, group_size, sym=bits == 8)
    try:
        return spec.validate(UniformFormat) if bits < 16 else spec
    except ValueError as e:
        raise ValueError(f"head_group_size (--head-group-size): {e}") from None


@dataclass
class Recipe:
    # the best uniform grid at 3-4 bits (docs/accuracy.md); 2 bits wants "bpdq"
    method: str = "awq+gptq"
    w_bits: int = 4
    group_size: int | None = None  # None: the solver's format's default (128 for integer grids, 32 for MXINT)
    sym: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # solver options, e.g. {"act_order": True}
    stage_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per transform/policy name
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # glob on linear name -> spec fields
    skip: tuple[str, ...] = ()  # globs of linears kept in full precision
    a_bits: int = 16  # per-token dynamic activation quantization of every linear's input (16: off)
    a_sym: bool = False
    a_clip: float | None = 1.0  # clipping ratio of the activation range; None: searched per linear
    a_format: str | None = None  # "int" or "mxint" grids for activations and KV cache; None: mxint for MXINT weights
    kv_bits: int = 16  # keys (after RoPE) and values, per head (16: off)
    kv_group_size: int = -1  # values per KV group along head_dim (-1: the whole head)
    kv_center: bool = True  # quantize keys around their calibrated mean (see bitquilt.nn.kv_quant)
    a8_layers: int = 0  # DynamicPTQ: this many decoder layers (chosen by residual-stream SNR) get 8-bit activations
    a8_snr_db: float | None = None  # DynamicPTQ: instead, every layer whose 4-bit SNR is below this (dB)
    recon_steps: int = 0  # block-wise learned rounding and clipping after the solver: steps per block (0: off)
    residual: str | None = None  # MosaicQuant: "mosaic" adds a sparse 4-bit residual to each solved linear
    residual_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"budget": 0.1, "block": (1, 32)}
    head_bits: int = 16  # LM head and input embeddings: 8 or 4 (RTN, uniform grid; bitquilt.pipeline.head), 16: off
    head_group_size: int = 128  # their group size along the hidden dimension (-1: one group per row)
    gguf_type: str | None = None  # a llama.cpp mix (Q4_K_M, ...): its block type per tensor, head and embeddings too

    def __post_init__(self) -> None:
        register_builtins()  # the names below are looked up in the registries
        self._check_types()
        self.method = expand_method(self.method)
        if self.gguf_type is not None:
            self._apply_gguf_type()
        self.skip = tuple(self.skip)
        if self.recon_steps < 0:
            raise ValueError(f"recon_steps must be ≥ 0 (0: no reconstruction), got {self.recon_steps}")
        if self.group_size is None:
            self.group_size = self.solver_spec.produces.default_group_size
        if self.a_format is None:
            self.a_format = "mxint" if self.solver_spec.produces.name == "mxint" else "int"
        for name in self.components:
            stage = STAGES.get(name)
            if stage.kind not in ("transform", "policy"):
                raise ValueError(f"{name!r} in method {self.method!r} is a {stage.kind} stage; only transforms "
                                 "and policies may precede the solver")
        self.solver_spec.make_options(self.options)
        self.solver_spec.validate(self.default_spec)
        if self.residual is not None:
            residual = RESIDUALS.get(self.residual)
            residual.make_options(self.residual_options)
            if self.solver not in residual.bases:
                raise ValueError(f"residual {self.residual!r} extends a {' or '.join(residual.bases)} base; method "
                                 f"{self.method!r} ends in {self.solver!r}")
        elif self.residual_options:
            raise ValueError(f"residual options {sorted(self.residual_options)} without a residual method "
                             f"(--residual {' | '.join(RESIDUALS)})")
        self.default_act.validate()
        self.kv_config().validate()
        for pattern, fields in self.overrides.items():
            bad = set(fields) - WEIGHT_FIELDS - set(ACT_FIELDS)
            if bad:
                raise ValueError(f"override {pattern!r}: unknown field(s) {sorted(bad)}; "
                                 f"use {', '.join(sorted(WEIGHT_FIELDS | set(ACT_FIELDS)))}")
            try:
                self.solver_spec.validate(LayerSpec(**{**asdict(self.default_spec),
                                                       **{k: v for k, v in fields.items() if k in WEIGHT_FIELDS}}))
                ActQuantConfig(**{**asdict(self.default_act),
                                  **{ACT_FIELDS[k]: v for k, v in fields.items() if k in ACT_FIELDS}}).validate()
            except (TypeError, ValueError) as e:
                raise ValueError(f"override {pattern!r}: {e}") from None
        names = {s.name for s, _ in self.stages()} - {"solve"}
        unknown = sorted(set(self.stage_options) - names)
        if unknown:
            runs = f"its stages: {', '.join(sorted(names))}" if names else "it runs its solver alone"
            raise ValueError(f"stage options for {unknown}, which recipe {self.method!r} does not run; {runs}")
        if (self.a8_layers or self.a8_snr_db is not None) and self.a_bits >= 8:
            raise ValueError(f"--a8-layers/--a8-snr-db widen 4-bit activations to 8 bits in chosen layers; the "
                             f"recipe's activations are {self.a_bits}-bit (use --a-bits 4)")
        if self.a8_layers < 0:
            raise ValueError(f"a8_layers must be ≥ 0, got {self.a8_layers}")
        head_spec(self.head_bits, self.head_group_size)
        if "quarot" in self.components and "awq" in self.components:
            raise ValueError("awq cannot follow quarot: its scales would cross the online Hadamard transforms")

    def _apply_gguf_type(self) -> None:
        """`gguf_type`: the method's solver solves onto llama.cpp's blocks (rtn → gguf_rtn, gptq → gguf_gptq), each
        linear on its mix's type (the `gguf_mix` policy), the LM head and embeddings too (`pipeline.head`);
        reconstruction (`recon_steps`) then trains the rounding and super-block scales on those blocks."""
        check_mix(self.gguf_type)
        *before, last = self.method.split("+")
        solver = GGUF_SOLVERS.get(last, last)
        if solver not in GGUF_SOLVERS.values():
            raise ValueError(f"--gguf-type (gguf_type) needs a method ending in rtn or gptq, which then solve onto "
                             f"llama.cpp's blocks; got {self.method!r}")
        for flag, value in (("--head-bits", self.head_bits < 16), ("--residual", self.residual is not None),
                            ("--a-bits", self.a_bits < 16), ("--kv-bits", self.kv_bits < 16)):
            if value:
                raise ValueError(f"--gguf-type (gguf_type) does not combine with {flag}: a GGUF mix fixes every "
                                 "weight's type and llama.cpp quantizes no activations")
        self.method = "+".join([*before, solver])
        self.w_bits = block_type(MIXES[self.gguf_type]).bits

    @property
    def solver(self) -> str:
        return solver_name(self.method)

    @property
    def solver_spec(self) -> Solver:
        return get_solver(self.solver)

    @property
    def components(self) -> list[str]:
        """The transform and policy stages the method names, in order."""
        return self.method.split("+")[:-1]

    @property
    def transforms(self) -> list[str]:
        return [n for n in self.components if STAGES.get(n).kind == "transform"]

    def _searches_clip(self) -> bool:
        searched = self.a_bits < 16 and self.a_clip is None
        return searched or any(f.get("a_clip", 0) is None for f in self.overrides.values())

    def stages(self) -> list[tuple[Stage, Any]]:
        """Every stage this recipe runs, with its options: the method's, then the ones its settings imply
        (KV quantizers and key centres, activation clipping), then solving."""
        names = (["gguf_mix"] if self.gguf_type is not None else []) + list(self.components)
        if self.a8_layers or self.a8_snr_db is not None:
            names.append("dynamic_a8")
        if self.kv_bits < 16:
            names += ["kv_quant"] + (["kv_center"] if self.kv_center else [])
        if self._searches_clip():
            names.append("act_clip")
        required = {r for n in names for r in STAGES.get(n).requires}
        required |= {"fp_reference"} if self.recon_steps else set()
        names += sorted(required - set(names))
        implied = {"dynamic_a8": {"layers": self.a8_layers, "snr_db": self.a8_snr_db},
                   "recon": {"steps": self.recon_steps}, "gguf_mix": {"mix": self.gguf_type}}
        names += ["solve"] + (["recon"] if self.recon_steps else [])
        implied["solve"] = {"solver": self.solver, "options": self.options, "residual": self.residual,
                            "residual_options": self.residual_options}
        return [(STAGES.get(n), STAGES.get(n).make_options({**implied.get(n, {}), **self.stage_options.get(n, {})}))
                for n in names]

    @property
    def residual_spec(self) -> Any:
        """The residual method's options object, None without a residual."""
        return None if self.residual is None else RESIDUALS.get(self.residual).make_options(self.residual_options)

    @property
    def needs_calibration(self) -> bool:
        residual = self.residual_spec
        return (self.solver_spec.wants_stats(self.options) or (residual is not None and residual.needs_hessian)
                or any(s.needs_calibration for s, _ in self.stages()))

    @property
    def default_spec(self) -> LayerSpec:
        return LayerSpec(self.w_bits, self.group_size, self.sym)

    def _check_types(self) -> None:
        """Refuse values of the wrong kind before they are compared or used (a string where bits go, a float bit
        width that fails only when packing, a --skip string that would be split into one glob per character)."""
        integers = ("w_bits", "a_bits", "kv_bits", "kv_group_size", "a8_layers", "recon_steps", "head_bits",
                    "head_group_size")
        wrong = [f"{name}={getattr(self, name)!r} (an integer)" for name in integers
                 if not is_integer(getattr(self, name))]
        if self.group_size is not None and not is_integer(self.group_size):
            wrong.append(f"group_size={self.group_size!r} (an integer or None)")
        wrong += [f"{name}={getattr(self, name)!r} (a number or None)" for name in ("a_clip", "a8_snr_db")
                  if getattr(self, name) is not None and not is_number(getattr(self, name))]
        wrong += [f"{name}={getattr(self, name)!r} (True or False)" for name in ("sym", "a_sym", "kv_center")
                  if not isinstance(getattr(self, name), bool)]
        if self.gguf_type is not None and not isinstance(self.gguf_type, str):
            wrong.append(f"gguf_type={self.gguf_type!r} (a mix name such as 'Q4_K_M' or None)")
        if not isinstance(self.method, str):
            wrong.append(f"method={self.method!r} (a name such as 'gptq' or 'awq+gptq')")
        if isinstance(self.skip, str) or not all(isinstance(p, str) for p in self.skip):
            wrong.append(f"skip={self.skip!r} (a list of globs)")
        for name in ("options", "overrides", "stage_options", "residual_options"):
            if not isinstance(getattr(self, name), dict):
                wrong.append(f"{name}={getattr(self, name)!r} (a dict)")
        if wrong:
            raise ValueError(f"Recipe: {', '.join(wrong)} expected")

    @property
    def default_act(self) -> ActQuantConfig:
        return ActQuantConfig(self.a_bits, self.a_sym, -1, self.a_clip, self.a_format)

    def _fields_for(self, name: str, default: dict[str, Any], keys: dict[str, str]) -> dict[str, Any] | None:
        """`default` updated by the overrides matching `name` (override key -> field), None if skipped."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.skip):
            return None
        for pattern, fields in self.overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                default.update({keys[k]: v for k, v in fields.items() if k in keys})
        return default

    def spec_for(self, name: str) -> LayerSpec | None:
        """The grid for linear `name`, or None if it stays in full precision."""
        spec = self._fields_for(name, asdict(self.default_spec), {k: k for k in WEIGHT_FIELDS})
        return None if spec is None else self.solver_spec.validate(LayerSpec(**spec))

    def act_config_for(self, name: str) -> ActQuantConfig | None:
        """The input quantizer of linear `name`, or None if its input stays in full precision."""
        config = self._fields_for(name, asdict(self.default_act), ACT_FIELDS)
        config = None if config is None else ActQuantConfig(**config).validate()
        return config if config is not None and config.enabled else None

    def kv_config(self) -> ActQuantConfig:
        return ActQuantConfig(self.kv_bits, False, self.kv_group_size, format=self.a_format)

    def label(self) -> str:
        g = "pc" if self.group_size == -1 else f"g{self.group_size}"
        act = f" a{self.a_bits}" if self.a_bits < 16 else ""
        if self.a8_layers:
            act += f" a8×{self.a8_layers}"
        elif self.a8_snr_db is not None:
            act += f" a8<{self.a8_snr_db:g}dB"
        kv = f" kv{self.kv_bits}" if self.kv_bits < 16 else ""
        recon = f" recon{self.recon_steps}" if self.recon_steps else ""
        recon += f" head{self.head_bits}" if self.head_bits < 16 else ""
        residual = self.residual_spec
        extra = "" if residual is None else f" +{self.residual} {100 * residual.budget:g}%"
        if self.gguf_type is not None:
            return f"{self.method} {self.gguf_type}"
        return f"{self.method} w{self.w_bits}{g}{'s' if self.sym else ''}{extra}{act}{kv}{recon}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["skip"] = list(self.skip)
        return d

    def record(self) -> dict[str, Any]:
        """`to_dict` with every solver and stage option spelled out, defaults included, so that changing
        a default never changes what a saved recipe means."""
        stage_options = {s.name: asdict(o) for s, o in self.stages() if s.name != "solve" and asdict(o)}
        return {**self.to_dict(), "options": asdict(self.solver_spec.make_options(self.options)),
                "stage_options": stage_options}

    @classmethod
    def best(cls, w_bits: int = 4, **fields: Any) -> Recipe:
        """The CLI's default recipe at `w_bits` (`default_recipe`, for the `gguf_type` among `fields` if any), with
        `fields` overriding it (`Recipe.based_on`)."""
        return cls.based_on(default_recipe(w_bits, fields.get("gguf_type")), w_bits, **fields)

    @classmethod
    def reconstruction(cls, w_bits: int, group_size: int, **fields: Any) -> Recipe:
        """`RECON_RECIPE` at `w_bits` and `group_size`, with `fields` overriding it (`Recipe.based_on`)."""
        return cls.based_on({**RECON_RECIPE, "group_size": group_size}, w_bits, **fields)

    @classmethod
    def based_on(cls, base: dict[str, Any], w_bits: int, **fields: Any) -> Recipe:
        """The recipe of the fields in `base` at `w_bits`, `fields` overriding them (solver options merged, stage
        options merged per stage)."""
        chosen = {k: v for k, v in base.items() if k != "stage_options"}
        chosen["options"] = {**base.get("options", {}), **fields.pop("options", {})}
        recon = fields.get("recon_steps", base.get("recon_steps", 0))
        stage_options = {name: dict(opts) for name, opts in base.get("stage_options", {}).items()
                         if name != "recon" or recon}  # --recon-steps 0 drops the base recipe's recon settings
        for name, opts in fields.pop("stage_options", {}).items():
            stage_options.setdefault(name, {}).update(opts)
        return cls(**{**chosen, **fields, "w_bits": w_bits, "stage_options": stage_options})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        d = dict(d)
        if "transform_options" in d:  # saved before stages replaced transforms
            d["stage_options"] = d.pop("transform_options")
        return cls(**d)
