"""vLLM release profiles: what kvpolicy knows about one engine version, as data.

One YAML file per profile in ``policy/releases/`` holds the facts of one vLLM
release, each checked against the real release by ``tests/conformance/``: its
layouts, its attention backends (what each declares to the layout resolver,
MLA or not, its geometry), the ``kv_cache_dtype`` strings it accepts, its
registered KV connectors, its default block size, and the directory of the
shipped rules that reproduce its decision. Selecting a profile selects the
candidates, the geometry and the shipped rules together.

The profile is chosen by ``vllm_version=`` / ``--vllm-version``; by default,
the version of an installed ``vllm`` distribution (read from its package
metadata, never by importing vLLM) when a profile answers for it, else the
profile of its ``X.Y`` series, else the newest shipped profile (logged once
when the installed version has no profile of its own); ``KVPOLICY_VLLM_VERSION``
overrides that default. ``issue-48412`` is the development state in which
vLLM issue #48412 was found; no default ever selects it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from enum import Enum
from importlib import metadata
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, field_validator

from kvpolicy.policy.backends import DEV_48412_BACKENDS, BackendProfile, Dim, KVSplit, ScaleViews, packed_backend
from kvpolicy.policy.errors import InputError, input_error
from kvpolicy.policy.layouts import HeadOrder, Layout
from kvpolicy.policy.spec import Frozen

__all__ = [
    "BackendFacts",
    "Geometry",
    "ReleaseProfile",
    "Resolver",
    "StrideOrders",
    "default_profile_name",
    "get_profile",
    "installed_vllm_version",
    "profile_names",
]

RELEASES_DIR = Path(__file__).with_name("releases")
ENV_VAR = "KVPOLICY_VLLM_VERSION"  # overrides the default profile (not an explicit `vllm_version`)


class Resolver(str, Enum):
    """How the release decides a layout."""

    kv_cache_layout = "kv_cache_layout"  # 0.29+: resolve_kv_cache_layout over the six KVCacheLayouts
    uniform_gate = "uniform_gate"  # 0.24-0.28: use_uniform_kv_cache, plus the head order


class Geometry(str, Enum):
    """How the release lays out the bytes of a layout."""

    packed = "packed"  # logical [L, B, H, N, C], K then V packed in C (0.26 on)
    # K and V in a dim of their own, logical [B, 2, N, H, D] (0.24-0.25), each backend's stride orders
    # giving the physical order; Triton's inline-scale views assume each layer's buffer is contiguous
    kv_dim = "kv-dim"
    dev_48412 = "dev-48412"  # a separate K/V dim, scale views assuming contiguous layers (not a release)


class StrideOrders(Frozen):
    """What a pre-0.29 backend's ``get_kv_cache_stride_order`` returns under one ``get_kv_cache_layout()``.

    Permutations of the backend's logical ``get_kv_cache_shape`` (``(B, H, N, C)``, MLA
    ``(B, N, C)``), without and with the leading num-layers dim. Null where vLLM raises
    ``NotImplementedError``: the runner then keeps the identity order per layer, and the
    backend never gets a cross-layer cache (``indexes_kv_by_block_stride`` is false).
    """

    per_layer: tuple[int, ...] | None = Field(default=None, description="`get_kv_cache_stride_order()`")
    cross_layer: tuple[int, ...] | None = Field(
        default=None, description="`get_kv_cache_stride_order(include_num_layers_dimension=True)`")


class BackendFacts(Frozen):
    """One attention backend as a release declares it."""

    mla: bool = False
    supported_layouts: tuple[Layout, ...] | None = Field(
        default=None, description="`supported_kv_cache_layouts()`, most preferred first; null: declares none")
    supported_layouts_by_capability: dict[int, tuple[Layout, ...]] = Field(
        default_factory=dict, description="overrides of `supported_layouts` by CUDA device capability major")
    kv_cache_dtypes: tuple[str, ...] | None = Field(
        default=None, description="`supported_kv_cache_dtypes`; null: not checked")
    stride_orders: dict[HeadOrder, StrideOrders] | None = Field(
        default=None, description="pre-0.29 releases: the stride orders under each `get_kv_cache_layout()`; "
                                  "they give the layouts the backend can allocate (null: every layout)")
    kv_split: KVSplit = Field(default=KVSplit.content,
                              description="where the backend's cache write finds K and V in C (packed geometry)")
    kv_dim: bool = Field(default=False, description="`get_kv_cache_shape` keeps K and V in a dim of their own, "
                         "`(B, 2, N, H, D)` (0.24-0.25), instead of packing them in C, `(B, H, N, 2D)`; the "
                         "stride orders permute that shape")

    def __hash__(self) -> int:
        return hash((self.mla, self.supported_layouts, tuple(sorted(self.supported_layouts_by_capability.items())),
                     self.kv_cache_dtypes, tuple(sorted((self.stride_orders or {}).items())), self.kv_split,
                     self.kv_dim))

    @property
    def logical_shape(self) -> str:
        """The dims of ``get_kv_cache_shape``: ``BHNC``, MLA ``BNC``, ``BKNHC`` with a K/V dim (K)."""
        return "BNC" if self.mla else "BKNHC" if self.kv_dim else "BHNC"

    def allocated_layout(self, head_order: HeadOrder, cross_layer: bool) -> Layout | None:
        """The layout vLLM allocates under ``head_order``, per layer or cross-layer, from the stride orders.

        Per layer the layer dim is outermost (one buffer per layer); cross-layer only when the
        block dim is outermost (vLLM's ``indexes_kv_by_block_stride``), else None. MLA's shape has
        no head dim: its layouts are named with H beside N (H=1, the same bytes).
        """
        if self.stride_orders is None:
            return None
        physical = self.physical_order(head_order, cross_layer)
        return None if physical is None else _layout_name(physical.replace("K", ""))

    def physical_order(self, head_order: HeadOrder, cross_layer: bool) -> str | None:
        """The dims vLLM allocates, outermost first, layer dim included (``LBHNC``, ``BLKNHC``): the
        stride order applied to `logical_shape`; None where there is no cross-layer order."""
        if self.stride_orders is None:
            return None
        orders = self.stride_orders[head_order]
        logical = self.logical_shape
        if not cross_layer:
            order = orders.per_layer if orders.per_layer is not None else tuple(range(len(logical)))
            return "L" + "".join(logical[i] for i in order)
        if orders.cross_layer is None or orders.cross_layer[0] == 0:
            return None
        return "".join(("L" + logical)[i] for i in orders.cross_layer)

    def allocated_layouts(self) -> tuple[Layout, ...] | None:
        """Every layout the stride orders give (None: no stride orders, every layout)."""
        if self.stride_orders is None:
            return None
        found = {self.allocated_layout(h, cross) for h in self.stride_orders for cross in (False, True)}
        return tuple(x for x in Layout if x in found)

    def declared_layouts(self, device_capability: int | None) -> tuple[Layout, ...] | None:
        if device_capability is not None and device_capability in self.supported_layouts_by_capability:
            return self.supported_layouts_by_capability[device_capability]
        return self.supported_layouts


class ReleaseProfile(Frozen):
    """The facts of one vLLM release (or of the #48412 development state)."""

    name: str
    description: str
    extends: str | None = Field(default=None, description="the profile whose facts this one's file amends "
                                "(a JSON Merge Patch: what differs, nothing else)")
    vllm_versions: tuple[str, ...] = Field(description="installed vLLM versions this profile answers for")
    historical: bool = Field(default=False, description="a development state: never selected by default")
    resolver: Resolver
    geometry: Geometry
    layer_buffers: bool = Field(description="layer-compact layouts allocate one buffer per layer")
    layouts: tuple[Layout, ...] = Field(description="the candidates this release has")
    default_layout_preference: tuple[Layout, ...] = Field(
        description="the order used when no backend declares its layouts (vLLM's _DEFAULT_LAYOUT_PREFERENCE)")
    default_block_size: int
    kv_cache_dtypes: tuple[str, ...]
    backends: dict[str, BackendFacts]
    connectors: dict[str, str] = Field(description="registered KV connector names -> the class each loads")
    hisparse_connectors: tuple[str, ...] = Field(
        default=(), description="connectors whose presence in the KV transfer config turns HiSparse "
        "(`attention_config.hisparse_config`) on, and without one of which a HiSparse config is refused "
        "(vLLM 0.34's `VllmConfig.__post_init__`)")
    options: tuple[Literal["enable_extensible_kv_cache", "hisparse"], ...] = Field(
        default=(), description="the vLLM settings of the layout decision this release has beyond "
        "`VLLM_KV_CACHE_LAYOUT` and the device capability (`build_context` refuses the others when set)")
    rules: tuple[str, ...] = Field(description="the shipped rules' directories, relative to the rules root, bottom "
                                   "layer first (a string: one directory); neighbouring releases share layers")
    kv_transfer_config_fields: tuple[str, ...] = Field(
        default=(), description="the fields of this release's `KVTransferConfig` (vllm/config/kv_transfer.py), "
        "what `--kv-transfer-config` may hold; empty: not checked")
    backend_priority: dict[str, tuple[str, ...]] = Field(
        default_factory=dict, description="the backends vLLM's CUDA platform tries, in order, with no "
        "attention backend configured (platforms/cuda.py `_get_backend_priorities`), keyed `mla` / "
        "`attention` for SM90 and `mla@10` / `attention@10` where a capability's list differs")

    def __hash__(self) -> int:
        return hash(self.name)

    @field_validator("rules", mode="before")
    @classmethod
    def _one_directory(cls, value: object) -> object:
        return (value,) if isinstance(value, str) else value

    @property
    def rules_label(self) -> str:
        """How the shipped rules show: ``rules/vllm-0.34``, layers as ``rules/vllm-gate + rules/...``."""
        return " + ".join(f"rules/{d}" for d in self.rules)

    @property
    def version_label(self) -> str:
        """``vLLM 0.34.0``, or the profile's name for a development state that is no release."""
        return f"vLLM {', '.join(self.vllm_versions)}" if self.vllm_versions else f"the `{self.name}` state"

    def kv_cache_layout_values(self) -> tuple[str, ...]:
        """What ``VLLM_KV_CACHE_LAYOUT`` may be set to: a layout name or the NHD/HND aliases (0.29 on);
        NHD or HND only where the uniform gate decides (0.28's ``get_kv_cache_layout``)."""
        names = () if self.resolver is Resolver.uniform_gate else tuple(x.value for x in Layout)
        return (*names, "NHD", "HND")

    def backend_names(self) -> tuple[str, ...]:
        return tuple(self.backends)

    def backend(self, name: str) -> BackendProfile:
        """The geometry of backend ``name`` in this release; an `InputError` with the known names."""
        key = _backend_key(name, self.backends)
        if key is None:
            import difflib

            close = difflib.get_close_matches(name.upper(), list(self.backends), n=1)
            raise input_error("attention_backend", f"unknown attention backend `{name}` in profile `{self.name}`",
                              (f"did you mean `{close[0]}`? " if close else "")
                              + "known backends: " + ", ".join(self.backends), code="unknown-backend")
        return _geometry(self, key)

    def declared_layouts(self, backends: Sequence[Sequence[str]], device_capability: int | None = None
                         ) -> tuple[Layout, ...]:
        """The candidates in vLLM's preference order for these workers' backends.

        Each worker reports the layouts all its backends support (vLLM's
        ``get_supported_kv_cache_layouts``), and the engine core merges the
        workers' lists (``_merge_supported_layouts``): identical lists keep
        their order; otherwise the layouts in every list, ranked by how many
        lists put them first, ties in enum order. Backends and workers that
        declare nothing do not vote. An empty result means no layout fits
        every backend. Releases with the uniform gate have no such lists: every
        layout of the profile is a candidate, in its default order.
        """
        if self.resolver is Resolver.uniform_gate:
            return self.default_layout_preference
        reports = []
        for worker in backends:
            declared = [d for d in (self.backends[_backend_key(b, self.backends) or b].declared_layouts(
                device_capability) for b in worker if _backend_key(b, self.backends)) if d is not None]
            reports.append(_merge(declared or [self.default_layout_preference]))
        voting = [r for r in reports if r != self.default_layout_preference] or reports
        return _merge(voting) if voting else self.default_layout_preference


def _layout_name(physical: str) -> Layout:
    """``BLNC`` (MLA, no head dim) -> ``BLNHC``; ``BHLNC`` as it is."""
    return Layout(physical if "H" in physical else physical.replace("NC", "NHC"))


def _backend_key(name: str, backends: dict[str, BackendFacts]) -> str | None:
    if not isinstance(name, str):
        return None
    if name in backends:
        return name
    upper = name.upper()
    return upper if upper in backends else None


def _merge(lists: Sequence[Sequence[Layout]]) -> tuple[Layout, ...]:
    """vLLM 0.34's ``_merge_supported_layouts`` (conformance-tested against it)."""
    if not lists:
        return ()
    first = tuple(lists[0])
    if all(tuple(x) == first for x in lists[1:]):
        return first
    votes: dict[Layout, int] = defaultdict(int)
    for preferred, *_ in lists:
        votes[preferred] += 1
    common = set.intersection(*(set(x) for x in lists))
    return tuple(sorted((x for x in Layout if x in common), key=lambda x: votes[x], reverse=True))


@functools.cache
def _geometry(profile: ReleaseProfile, name: str) -> BackendProfile:
    facts = profile.backends[name]
    if profile.geometry is Geometry.dev_48412:
        return DEV_48412_BACKENDS[name]
    scale_views = ScaleViews.stride_aware
    if profile.geometry is Geometry.kv_dim and facts.kv_dim:
        return _kv_dim_backend(profile, name, facts)
    allocated = facts.allocated_layouts()
    layouts = profile.layouts if allocated is None else tuple(x for x in profile.layouts if x in allocated)
    return packed_backend(name, mla=facts.mla, layouts=layouts, layer_buffers=profile.layer_buffers,
                          supported_layouts=facts.supported_layouts, scale_views=scale_views,
                          kv_split=facts.kv_split)


_DIM_OF = {"L": Dim.layer, "B": Dim.block, "K": Dim.kv, "N": Dim.token, "H": Dim.head, "C": Dim.dim}


def _kv_dim_backend(profile: ReleaseProfile, name: str, facts: BackendFacts) -> BackendProfile:
    """A backend whose cache shape has a K/V dim (``(B, 2, N, H, D)``): each layout it allocates, in the
    physical order its stride orders give; the 0.24-0.25 Triton scale views (base offset 0, one layer
    page per block) assume one contiguous buffer per layer."""
    orders = {}
    for head_order in HeadOrder:
        for cross in (False, True):
            physical = facts.physical_order(head_order, cross)
            if physical is not None and (layout := _layout_name(physical.replace("K", ""))) in profile.layouts:
                orders[layout] = tuple(_DIM_OF[c] for c in physical)
    return BackendProfile(name=name, logical_dims=tuple(_DIM_OF[c] for c in facts.logical_shape), orders=orders,
                          layer_buffers=profile.layer_buffers, supported_layouts=facts.supported_layouts,
                          scale_views=ScaleViews.assume_per_layer_contiguous)


def merge_patch(base: object, patch: object) -> object:
    """``patch`` applied to ``base`` as a JSON Merge Patch (RFC 7386): mappings merge key by key, a
    null value removes its key, anything else replaces. A profile states what differs from the
    profile it ``extends`` this way, so a fact shared by several releases is written once."""
    if not isinstance(patch, dict):
        return patch
    out = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _read_profile_files() -> dict[str, tuple[Path, dict]]:
    """Every profile file's own mapping (before ``extends``), by profile name."""
    raw: dict[str, tuple[Path, dict]] = {}
    for path in sorted(RELEASES_DIR.glob("*.yaml")):
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or data["name"] in raw:
            raise RuntimeError(f"release profile {path.name} is invalid: a mapping with a unique `name` expected")
        raw[data["name"]] = (path, data)
    return raw


@functools.cache
def profile_facts(name: str) -> dict:
    """The facts of profile ``name`` as one mapping: its own file applied to the profile it extends
    (recursively). Shipped data: a missing base or a cycle is a packaging defect (RuntimeError)."""
    raw = _read_profile_files()
    chain: list[str] = []
    at: str | None = name
    while at is not None:
        if at in chain or at not in raw:
            why = "a cycle" if at in chain else f"no profile `{at}`"
            raise RuntimeError(f"release profile {name}: `extends` reaches {why} ({' -> '.join([*chain, at])})")
        chain.append(at)
        at = raw[at][1].get("extends")
    root, *patches = [{k: v for k, v in raw[link][1].items() if k != "extends"} for link in reversed(chain)]
    facts = root  # the root states every fact, its nulls included (a null stride order is a fact)
    for patch in patches:
        facts = merge_patch(facts, patch)  # type: ignore[assignment]
    facts["extends"] = raw[name][1].get("extends")
    return facts


@functools.cache
def _profiles() -> dict[str, ReleaseProfile]:
    out: dict[str, ReleaseProfile] = {}
    for name, (path, _data) in _read_profile_files().items():
        try:
            profile = ReleaseProfile.model_validate(profile_facts(name))
        except ValidationError as exc:  # shipped data: a packaging defect, not a user's mistake
            raise RuntimeError(f"release profile {path.name} is invalid: {exc}") from None
        out[profile.name] = profile
    return out


def profile_names() -> tuple[str, ...]:
    """Every shipped profile, newest release first, historical ones last."""
    profiles = _profiles().values()
    ordered = sorted(profiles, key=lambda p: (p.historical, _version_key(p.vllm_versions[0]) if p.vllm_versions
                                              else ()), reverse=False)
    released = sorted((p for p in ordered if not p.historical), key=lambda p: _version_key(p.vllm_versions[0]),
                      reverse=True)
    return tuple(p.name for p in released) + tuple(p.name for p in ordered if p.historical)


def _version_key(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def installed_vllm_version() -> str | None:
    """The version of an installed ``vllm`` distribution, from its metadata (vLLM is not imported).

    None when there is none, or when its metadata cannot be read or names no version (a broken
    install must not stop a decision: the default then falls back to the newest profile).
    """
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None
    except Exception as exc:  # unreadable or undecodable METADATA, a dist-info that is not a directory, ...
        _log_once(f"kvpolicy: the installed vllm distribution's metadata cannot be read ({type(exc).__name__}: "
                  f"{exc}); deciding with the newest release profile")
        return None
    return version if isinstance(version, str) and version.strip() else None


@functools.cache
def _log_once(message: str) -> None:
    logging.getLogger("kvpolicy").warning(message)


def _series(version: str) -> tuple[int, int] | None:
    """``0.28.1``, ``0.28.0.post1+cu121``, ``0.28.1rc2`` -> (0, 28); None when not ``X.Y...``."""
    match = re.match(r"v?(\d+)\.(\d+)(?![\d])", version.strip())
    return (int(match[1]), int(match[2])) if match else None


def _for_version(version: str) -> ReleaseProfile | None:
    for profile in _profiles().values():
        if profile.historical:
            continue
        for known in profile.vllm_versions:
            if version == known or version.split("+")[0] == known:
                return profile
    return None


def default_profile_name() -> str:
    """``KVPOLICY_VLLM_VERSION`` when set (an unknown one is an `InputError` located at the variable);
    else the installed vLLM's profile when one answers for it, else its ``X.Y`` series' profile,
    else the newest shipped release."""
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        try:
            return get_profile(chosen).name
        except InputError as exc:  # name the variable, not a flag the user never typed
            d = exc.diagnostics[0]
            raise input_error(ENV_VAR, f"the environment variable {ENV_VAR} names no release profile: "
                              f"`{chosen}`", f"unset {ENV_VAR} or set it to a known one; {d.help}",
                              code=d.code) from None
    installed = installed_vllm_version()
    newest = profile_names()[0]
    if installed is None:
        return newest
    profile = _for_version(installed)
    if profile is not None:
        return profile.name
    # A release without a profile of its own (a patch or pre-release, a local build): the profile of
    # its X.Y series when one is shipped (0.28.1 decides as vllm-0.28, not as the newest release),
    # else the newest; said once, since the decision then reproduces another release.
    series = _series(installed)
    same = [p for p in _profiles().values() if not p.historical and series is not None
            and any(_series(v) == series for v in p.vllm_versions)]
    chosen = same[0].name if same else newest
    why = "its series" if same else "the newest shipped release"
    _log_once(f"kvpolicy: no release profile answers for the installed vLLM {installed}; deciding with "
              f"`{chosen}` ({why}). Pass --vllm-version / vllm_version= (or set {ENV_VAR}) to choose")
    return chosen


def get_profile(name: str | None = None) -> ReleaseProfile:
    """The profile called ``name`` (``vllm-0.34`` or a version such as ``0.34.0``); the default when None.

    An unknown name is an `InputError` listing the known profiles.
    """
    if name is None:
        name = default_profile_name()
    if isinstance(name, ReleaseProfile):
        return name
    profiles = _profiles()
    if isinstance(name, str):
        if name in profiles:
            return profiles[name]
        if f"vllm-{name}" in profiles:
            return profiles[f"vllm-{name}"]
        by_version = _for_version(name)
        if by_version is not None:
            return by_version
    known = ", ".join(f"{p} ({', '.join(profiles[p].vllm_versions) or 'not a release'})" for p in profile_names())
    raise input_error("vllm_version", f"no profile for vLLM version `{name}`",
                      f"known profiles: {known}", code="unknown-vllm-version")


def iter_profiles() -> Iterable[ReleaseProfile]:
    return (get_profile(n) for n in profile_names())
