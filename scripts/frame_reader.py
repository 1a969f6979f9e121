"""For ``scripts.bench_gpu_trainer``: reads push socket frames from each connection into
reused memory, as a server does, and answers one byte after each stream's end frame. It
prints its port first; a connection whose first frame is the end frame stops it."""

import socket

import numpy as np

from skyrl_grpc.socket_frames import recv_frame

listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
memory = np.empty(16 << 20, dtype=np.uint8)
while True:
    connection, _ = listener.accept()
    received = 0
    while True:
        frame = recv_frame(connection, 1 << 30, lambda size: memory.data[:size])
        if frame is None or not len(frame):
            break
        received += len(frame)
    connection.sendall(b"k")
    connection.close()
    if received == 0:
        break
