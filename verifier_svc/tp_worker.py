"""Tensor parallelism across processes: worker ranks 1..N-1 and rank 0's step broadcast.

The verifier process is rank 0: it runs the engine as with one rank and, before each
forward, broadcasts the step's inputs. Ranks 1..N-1 are `python -m verifier_svc.tp_worker`
processes it starts (`TensorParallelGroup.start`). Each loads its weight shard, allocates
its KV shard with rank 0's block count, then loops: receive a step, run the same forward
(taking part in its all-reduces), drop the result. Rank 0 alone computes logits and samples.

Step message: one int64 tensor broadcast over a *control* group,
`[opcode, num_tokens, num_seqs, num_table_entries | query_start_locs (num_seqs + 1) |
context_lens | table_lens (num_seqs each) | input_ids | positions | slot_mapping
(num_tokens each) | block tables (num_table_entries)]`, block tables cut to the blocks that
cover each context. The first broadcast always carries MESSAGE_INLINE elements, so a
typical step costs one broadcast; a longer message sends its remainder in a second one.

Failure: the control group waits without a practical limit (an idle verifier sends no
steps), the compute group's all-reduces time out after COLLECTIVE_TIMEOUT_S. Rank 0 checks
that every worker process is alive before each step and fails the step loudly otherwise;
a worker exits when rank 0's process goes away (gloo sees the closed connection; a
watchdog thread also checks the parent pid). Any failure marks the group broken: every later
step raises `TensorParallelError` and the verifier's server stops (see `verifier_svc.server`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from specdec.device import DTYPES
from specdec.engine.kv_cache import KVCache
from specdec.layers.attention import AttentionMetadata
from specdec.models.parallel import ParallelContext

logger = logging.getLogger("verifier_svc.tp_worker")  # also when run as __main__

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
OP_STEP, OP_STOP = 1, 2
HEADER_LEN = 4
MESSAGE_INLINE = 4096
COLLECTIVE_TIMEOUT_S = 120.0
# The control group waits for the next step as long as the verifier stays idle.
CONTROL_TIMEOUT = timedelta(days=30)
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
_READY_KEY = "specdec/tp/ready/{rank}"
_POLL_S = 0.05


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or a collective failed; the group cannot serve again."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU, or accelerator r of this host."""
    return device if device.type == "cpu" else torch.device(device.type, rank)


class TensorParallelGroup:
    """Rank 0's handle on the workers: start them, broadcast each step, stop them."""

    def __init__(self, context: ParallelContext, procs: list[subprocess.Popen[bytes]],
                 control: dist.ProcessGroup, device: torch.device, block_size: int,
                 message_inline: int) -> None:
        self.context = context
        self.procs = procs
        self.device = device
        self.block_size = block_size
        self.failure: str | None = None
        self.num_steps = 0
        self.num_split_messages = 0  # steps whose message took a second broadcast
        self._control = control
        self._inline = torch.zeros(message_inline, dtype=torch.long, device=device)
        self._closed = False
        atexit.register(self.close)

    @classmethod
    def start(cls, context: ParallelContext, *, model_dir: Path, dtype: torch.dtype,
              device: torch.device, num_blocks: int, block_size: int,
              max_positions: int | None = None, threads: int | None = None,
              linear_kernel: str | None = None, message_inline: int | None = None,
              ready_timeout_s: float = READY_TIMEOUT_S,
              attention_backend: str | None = None) -> TensorParallelGroup:
        """Starts ranks 1..N-1 and joins them; returns once every rank has loaded its shard.

        `linear_kernel` is the packed kernel rank 0 uses (`specdec.models.packed_linear`), so
        every rank computes its shard the same way (and, for int8, holds the same model).
        `message_inline` (default MESSAGE_INLINE) is the length of the first broadcast.
        `attention_backend`: rank 0's (None: each rank's environment's).
        """
        message_inline = max(HEADER_LEN, message_inline or MESSAGE_INLINE)
        if dist.is_initialized():
            raise TensorParallelError("a torch.distributed process group already exists in this "
                                      "process; one tensor-parallel verifier per process")
        world_size = context.world_size
        backend = BACKENDS[device.type]
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                              timeout=timedelta(seconds=ready_timeout_s), wait_for_workers=False)
        if threads is None and device.type == "cpu":
            threads = max(1, torch.get_num_threads() // world_size)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, world_size):
                command = [sys.executable, "-m", "verifier_svc.tp_worker",
                           "--model-dir", str(model_dir), "--dtype", _dtype_name(dtype),
                           "--device", device.type, "--rank", str(rank),
                           "--world-size", str(world_size), "--store-port", str(store.port),
                           "--num-blocks", str(num_blocks), "--block-size", str(block_size),
                           "--parent-pid", str(os.getpid()),
                           "--message-inline", str(message_inline),
                           "--log-level", logging.getLevelName(logging.getLogger().level).lower()]
                if max_positions is not None:
                    command += ["--max-positions", str(max_positions)]
                if threads is not None:
                    command += ["--threads", str(threads)]
                if linear_kernel is not None:
                    command += ["--linear-kernel", linear_kernel]
                if attention_backend is not None:
                    command += ["--attention-backend", attention_backend]
                procs.append(subprocess.Popen(command))
            _wait_ready(store, procs, ready_timeout_s)
            dist.init_process_group(backend, store=store, rank=0, world_size=world_size,
                                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            control = dist.new_group(list(range(world_size)), timeout=CONTROL_TIMEOUT,
                                     backend=backend)
        except BaseException:
            _terminate(procs)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        context.group = dist.group.WORLD
        logger.info("tensor parallel: %d ranks over %s, workers %s", world_size, backend,
                    ", ".join(f"rank {rank} pid {proc.pid}" for rank, proc in
                              enumerate(procs, start=1)))
        return cls(context, procs, control, device, block_size, message_inline)

    # ------------------------------------------------------------ per step

    def poll_failure(self) -> str | None:
        """Why the group cannot serve (a worker exited, a collective failed), or None."""
        if self.failure is None:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None:
                    self.failure = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                                    f"exited with code {code}")
                    logger.error("%s", self.failure)
                    break
        return self.failure

    @contextlib.contextmanager
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor,
             metadata: AttentionMetadata) -> Iterator[None]:
        """Sends the step to the workers; the body runs rank 0's forward.

        Any error inside (a collective that timed out or lost a peer) breaks the group: the
        ranks can no longer be sure to meet at the same collective.
        """
        failure = self.poll_failure()
        if failure is not None:
            raise TensorParallelError(failure)
        try:
            self._broadcast(self._pack(input_ids, positions, metadata))
            yield
        except Exception as exc:
            if self.failure is None:
                self.poll_failure()
            if self.failure is None:
                self.failure = f"tensor-parallel step failed: {type(exc).__name__}: {exc}"
                logger.error("%s", self.failure)
            raise TensorParallelError(self.failure) from exc

    def _pack(self, input_ids: torch.Tensor, positions: torch.Tensor,
              metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        num_seqs = len(metadata.context_lens)
        tables = [table[:-(-context_len // self.block_size)]
                  for table, context_len in zip(metadata.block_tables, metadata.context_lens)]
        table_lens = [table.shape[0] for table in tables]
        ints = [OP_STEP, num_tokens, num_seqs, sum(table_lens), *metadata.query_start_locs,
                *metadata.context_lens, *table_lens]
        head = torch.tensor(ints, dtype=torch.long).to(self.device, non_blocking=True)
        return torch.cat([head, input_ids, positions, metadata.slot_mapping, *tables])

    def _broadcast(self, message: torch.Tensor) -> None:
        length = message.shape[0]
        inline = self._inline
        inline_len = inline.shape[0]
        if length >= inline_len:
            inline.copy_(message[:inline_len])
        else:
            inline[:length].copy_(message)
        dist.broadcast(inline, src=0, group=self._control)
        self.num_steps += 1
        if length > inline_len:
            dist.broadcast(message[inline_len:].contiguous(), src=0, group=self._control)
            self.num_split_messages += 1

    # ------------------------------------------------------------ shutdown

    def close(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stops the workers (a STOP message, then SIGKILL after `timeout_s`; at once when the
        group is broken) and leaves the process group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.poll_failure() is not None:
            # The survivors wait for a step that will never come: nothing to finish.
            _terminate(self.procs)
        else:
            try:
                self._inline[:HEADER_LEN] = torch.tensor([OP_STOP, 0, 0, 0])
                dist.broadcast(self._inline, src=0, group=self._control)
            except Exception as exc:
                logger.warning("could not send STOP to the tensor-parallel workers: %s", exc)
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker rank %d did not stop in %.0f s; killing it",
                               rank, timeout_s)
                proc.kill()
                proc.wait()
        self.context.group = None
        if dist.is_initialized():
            dist.destroy_process_group()
        logger.info("tensor-parallel workers stopped")


def _wait_ready(store: dist.TCPStore, procs: list[subprocess.Popen[bytes]],
                timeout_s: float) -> None:
    """Waits until every worker has loaded its shard; a worker that fails or dies raises."""
    deadline = time.monotonic() + timeout_s
    pending = dict(enumerate(procs, start=1))
    while pending:
        for rank, proc in list(pending.items()):
            key = _READY_KEY.format(rank=rank)
            if store.check([key]):
                status = store.get(key).decode()
                if status != "ok":
                    raise TensorParallelError(f"tensor-parallel worker rank {rank} failed to "
                                              f"start: {status}")
                del pending[rank]
            elif proc.poll() is not None:
                raise TensorParallelError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                                          f"exited with code {proc.returncode} while starting")
        if pending and time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel workers {sorted(pending)} not ready in "
                                      f"{timeout_s:.0f} s")
        if pending:
            time.sleep(_POLL_S)


def _terminate(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# ---------------------------------------------------------------- the worker process


def _receive(buffer: torch.Tensor, control: dist.ProcessGroup,
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None:
    """The next step's inputs from rank 0, or None at STOP; `buffer` is the first broadcast's."""
    dist.broadcast(buffer, src=0, group=control)
    inline_len = buffer.shape[0]
    opcode, num_tokens, num_seqs, num_table_entries = buffer[:HEADER_LEN].tolist()
    if opcode == OP_STOP:
        return None
    lists_len = 3 * num_seqs + 1
    length = HEADER_LEN + lists_len + 3 * num_tokens + num_table_entries
    message = buffer
    if length > inline_len:
        rest = torch.empty(length - inline_len, dtype=torch.long, device=buffer.device)
        dist.broadcast(rest, src=0, group=control)
        message = torch.cat([buffer, rest])
    ints = message[HEADER_LEN:HEADER_LEN + lists_len].tolist()
    query_start_locs = ints[:num_seqs + 1]
    context_lens = ints[num_seqs + 1:2 * num_seqs + 1]
    table_lens = ints[2 * num_seqs + 1:]
    offset = HEADER_LEN + lists_len
    input_ids, positions, slot_mapping = message[offset:offset + 3 * num_tokens].split(num_tokens)
    tables = message[offset + 3 * num_tokens:length]
    metadata = AttentionMetadata(slot_mapping=slot_mapping, query_start_locs=query_start_locs,
                                 context_lens=context_lens,
                                 block_tables=list(tables.split(table_lens)))
    return input_ids, positions, metadata


def _watch_parent(parent_pid: int) -> None:
    """Exits this process when the verifier (rank 0) is gone, whatever the backend does."""
    while True:
        if os.getppid() != parent_pid:
            logger.error("rank 0 (pid %d) is gone; exiting", parent_pid)
            os._exit(1)
        time.sleep(1.0)


def run_worker(args: argparse.Namespace) -> int:
    from specdec.models.loader import load_model

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when workers stop
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = rank_device(torch.device(args.device), args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu and the hccl backend)
        torch.npu.set_device(device)  # type: ignore[attr-defined]
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world_size, is_master=False,
                          timeout=timedelta(seconds=READY_TIMEOUT_S))
    context = ParallelContext(rank=args.rank, world_size=args.world_size)
    dtype = DTYPES[args.dtype]
    try:
        model = load_model(Path(args.model_dir), dtype, device, args.max_positions, parallel=context,
                           attention_backend=args.attention_backend)
        if args.linear_kernel is not None:
            from specdec.models.packed_linear import pack_linears

            pack_linears(model, args.linear_kernel)
        kv_cache = KVCache.allocate(model.config, args.num_blocks, args.block_size, dtype, device)
    except Exception as exc:
        logger.exception("rank %d failed to load its shard", args.rank)
        store.set(_READY_KEY.format(rank=args.rank), f"{type(exc).__name__}: {exc}")
        return 1
    store.set(_READY_KEY.format(rank=args.rank), "ok")
    backend = BACKENDS[device.type]
    dist.init_process_group(backend, store=store, rank=args.rank, world_size=args.world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    control = dist.new_group(list(range(args.world_size)), timeout=CONTROL_TIMEOUT, backend=backend)
    context.group = dist.group.WORLD
    buffer = torch.zeros(args.message_inline, dtype=torch.long, device=device)
    num_steps = 0
    with torch.inference_mode():
        while (step := _receive(buffer, control)) is not None:
            input_ids, positions, metadata = step
            model(input_ids, positions, kv_cache, metadata)
            num_steps += 1
    logger.info("rank %d stopping after %d steps", args.rank, num_steps)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    from specdec.cli import LOG_LEVELS, DefaultsHelpFormatter, setup_logging

    parser = argparse.ArgumentParser(prog="python -m verifier_svc.tp_worker",
                                     formatter_class=DefaultsHelpFormatter,
                                     description="one tensor-parallel rank of the verifier "
                                                 "(started by the verifier, not by hand)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", required=True, choices=sorted(DTYPES))
    parser.add_argument("--device", required=True, choices=sorted(BACKENDS))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--num-blocks", type=int, required=True)
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--max-positions", type=int, default=None)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--message-inline", type=int, default=MESSAGE_INLINE)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--linear-kernel", default=None, help="packed linear kernel, as rank 0's")
    parser.add_argument("--attention-backend", default=None, help="rank 0's")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    setup_logging(args.log_level if args.log_level in LOG_LEVELS else "info",
                  f"tp-worker-{args.rank}")
    return run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
