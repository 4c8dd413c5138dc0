"""SSD transfer priorities (storage/io_engine.py): a read that compute waits for overtakes queued
optimizer-state traffic; within one priority, transfers keep their submission order."""
import threading

import torch

from snake_strategy.storage import SsdDirectory
from snake_strategy.storage.aligned import PAGE_BYTES, aligned_empty
from snake_strategy.storage.io_engine import BACKGROUND, IOEngine, set_thread_priority


def test_urgent_read_overtakes_queued_background_traffic(tmp_path):
    started, release = threading.Event(), threading.Event()
    order: list[tuple[str, int]] = []

    def hook(direction, num_bytes):
        order.append((direction, num_bytes))
        if len(order) == 1:
            started.set()
            assert release.wait(30)  # hold the only I/O thread: everything else queues

    ssd = SsdDirectory(str(tmp_path / "ssd"))
    io = IOEngine(num_threads=1, chunk_bytes=PAGE_BYTES, before_transfer=hook)
    try:
        fd = ssd.open("state/x.bin", 16 * PAGE_BYTES)
        data = aligned_empty(16 * PAGE_BYTES, torch.uint8)
        data.fill_(7)
        tickets = []

        def optimizer_worker():
            set_thread_priority(BACKGROUND)
            tickets.append(io.submit_write(fd, 0, data[:8 * PAGE_BYTES], "exp_avg"))  # 8 chunks

        worker = threading.Thread(target=optimizer_worker)
        worker.start()
        worker.join()
        assert started.wait(30)  # chunk 1 of the background write is on the "disk"
        out = aligned_empty(2 * PAGE_BYTES, torch.uint8)
        urgent = io.submit_read(fd, 8 * PAGE_BYTES, out, "weights")  # the main thread: urgent, 2 chunks
        checkpoint_write = io.submit_write(fd, 10 * PAGE_BYTES, data[:PAGE_BYTES], "checkpoints")
        release.set()
        urgent.wait()
        checkpoint_write.wait()
        tickets[0].wait()
    finally:
        io.close()
        ssd.close()
    directions = [d for d, _ in order]
    # the chunk already running, then the urgent read's 2 chunks, then the main thread's write (NORMAL),
    # then the 7 queued background chunks in submission order
    assert directions == ["write", "read", "read", "write"] + ["write"] * 7, order


def test_errors_reach_the_ticket_and_close_finishes_queued_work(tmp_path):
    ssd = SsdDirectory(str(tmp_path / "ssd"))
    io = IOEngine(num_threads=2, chunk_bytes=PAGE_BYTES)
    try:
        fd = ssd.open("state/y.bin", 4 * PAGE_BYTES)
        data = aligned_empty(4 * PAGE_BYTES, torch.uint8)
        data.fill_(3)
        write = io.submit_write(fd, 0, data, "weights")
        out = aligned_empty(PAGE_BYTES, torch.uint8)
        write.wait()
        short = io.submit_read(fd, 8 * PAGE_BYTES, out, "weights")  # past the end of the file
        try:
            short.wait()
            raise AssertionError("a read past the end must fail")
        except OSError as err:
            assert "short read" in str(err) or "shorter" in str(err)
        last = io.submit_write(fd, 0, data, "weights")
    finally:
        io.close()  # waits for the queued write
        ssd.close()
    assert last.done()
