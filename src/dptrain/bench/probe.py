"""Both ends of the link probe: a TCP round trip (median of 20 one-byte pings) and a bulk transfer's rate.

    python probe.py serve PORT                 # on one host
    python probe.py probe HOST PORT BYTES      # on the other: prints JSON

Run by path with the standard library only, so it starts in milliseconds inside a namespace.
"""

import json
import socket
import sys
import time

END = b"\x00END"


def _serve(port: int) -> None:
    """Answer each 1-byte ping, then swallow a bulk transfer and acknowledge it."""
    with socket.create_server(("0.0.0.0", port)) as listener:
        print("ready", flush=True)
        connection, _ = listener.accept()
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tail = b""
            while True:
                data = connection.recv(1 << 20)
                if not data:
                    return
                if data == b"p":
                    connection.sendall(b"p")
                    continue
                tail = (tail + data)[-4:]  # the end marker may arrive split over two reads
                if tail == END:
                    connection.sendall(b"k")


def _probe(host: str, port: int, payload: int) -> dict:
    with socket.create_connection((host, port), timeout=60) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(20):
            begun = time.perf_counter()
            connection.sendall(b"p")
            connection.recv(1)
            rtts.append(time.perf_counter() - begun)
        chunk = b"\x01" * 65536
        begun = time.perf_counter()
        sent = 0
        while sent < payload:
            connection.sendall(chunk)
            sent += len(chunk)
        connection.sendall(END)
        connection.recv(1)
        seconds = time.perf_counter() - begun
    return {"bandwidth_bytes_per_second": sent / seconds, "round_trip_seconds": sorted(rtts)[len(rtts) // 2]}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve(int(sys.argv[2]))
    else:
        print(json.dumps(_probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
