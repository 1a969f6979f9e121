"""The questions about weights the server asks vLLM's workers outside vLLM's lifecycle.

vLLM mixes ``WeightTransferWorker`` into its Worker (engine argument ``worker_extension_cls``);
the server calls its ``skyrl_*`` methods through ``collective_rpc`` (names in ``protocol``). The
weights themselves change only through vLLM's weight-transfer lifecycle, in this project's
engine (``transfer_engine``): these methods read that engine's state (the checkpoint layout,
checksums and bytes of the serving weights, what the last call did), drop its rollback copy,
and clear the KV cache memory after non-finite weights.
"""

from __future__ import annotations

from typing import Any

from servers.engine.transfer.protocol import Checksum, ParameterShape, Report
from skyrl_grpc.dtypes import torch_name


class WeightTransferWorker:
    """Mixin for vLLM's Worker."""

    # vLLM's Worker, which this class is mixed into, provides these.
    model_runner: Any
    weight_transfer_engine: Any

    def _skyrl_engine(self) -> Any:
        from servers.engine.transfer.protocol import BACKEND
        from servers.engine.worker.transfer_engine import SkyrlWeightTransferEngine

        engine = self.weight_transfer_engine
        if not isinstance(engine, SkyrlWeightTransferEngine):
            raise RuntimeError(
                f"this engine's weight-transfer engine is {type(engine).__name__}, not "
                f"{BACKEND!r}: start vLLM with weight_transfer_config={{'backend': '{BACKEND}'}}"
            )
        return engine

    # Only TP rank 0 keeps the checkpoint copy (``tp_share``): the others answer empty, and the
    # server reads the first worker's answer.

    def skyrl_layout(self) -> dict[str, ParameterShape]:
        """Element type and shape of every checkpoint parameter."""
        engine = self._skyrl_engine()
        if not engine.holds_copy:
            return {}
        return {
            name: ParameterShape(dtype=torch_name(t.dtype), shape=list(t.shape))
            for name, t in engine.serving.tensors.items()
        }

    def skyrl_checksums(self, names: list[str]) -> list[Checksum]:
        """SHA-256 of the serving weights (all when ``names`` is empty), sorted by name."""
        from skyrl_grpc.tensor_bytes import sha256_of

        engine = self._skyrl_engine()
        if not engine.holds_copy:
            return []
        serving = engine.serving
        result = []
        for name in names or sorted(serving.tensors):
            tensor = serving.serving_value(name)
            result.append(
                Checksum(
                    name=name,
                    sha256=sha256_of(tensor),
                    dtype=torch_name(tensor.dtype),
                    shape=list(tensor.shape),
                )
            )
        return result

    def skyrl_read(self, names: list[str]) -> list[bytes]:
        """The serving bytes of ``names``, as the checkpoint holds them (a peer catching up
        reads them: ``ReadWeights``)."""
        from skyrl_grpc.tensor_bytes import flat_bytes

        engine = self._skyrl_engine()
        if not engine.holds_copy:
            return []
        serving = engine.serving
        return [bytes(flat_bytes(serving.serving_value(name)).numpy().data) for name in names]

    def skyrl_warm_reload(self, trim: bool = False) -> int:
        """Reloads every layer from the serving weights (``SkyrlWeightTransferEngine.warm_reload``);
        returns the parameters reloaded (0 on the ranks that keep no copy)."""
        return int(self._skyrl_engine().warm_reload(trim))

    def skyrl_prepare_spares(self) -> int:
        """Allocates and touches the staging a full update writes into
        (``ServingCheckpoint.prepare_spares``); returns its bytes (0 on the ranks that keep no
        copy, and where there is no copy to update)."""
        return int(self._skyrl_engine().prepare_spares())

    def skyrl_report(self) -> Report:
        """What this worker's last ``update_weights`` or ``finish_weight_update`` did."""
        report: Report = self._skyrl_engine().report
        return report

    def skyrl_recycle_rollback(self) -> None:
        """The rollback copy becomes spare staging for the update that starts."""
        engine = self._skyrl_engine()
        if engine.holds_copy:
            engine.serving.recycle_commit()

    def skyrl_free_rollback(self) -> int:
        """Frees the rollback copy and spare buffers and gives the freed heap back to the
        system (the fleet committed); returns the bytes of weights freed on this rank."""
        return int(self._skyrl_engine().free_rollback())

    def skyrl_clear_kv_cache(self) -> int:
        """Zeroes every KV cache tensor; returns the bytes cleared. Only while no request holds
        KV: non-finite values left in a block by non-finite weights reach the next requests
        that get that block (attention reads whole blocks, and 0 x NaN is NaN)."""
        cleared = 0
        for tensor in self.model_runner.kv_caches:
            tensor.zero_()
            cleared += tensor.numel() * tensor.element_size()
        return cleared
