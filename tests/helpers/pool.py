"""A worker process entry point for the pool tests that imports nothing heavy (a spawned
child loads only this module): it dies half way through writing a message."""

import os
import struct


def dies_mid_message(spec, tasks, results):
    """Writes the header of a 1 MiB message (over 16 KiB: header and body are two writes),
    then the process is killed before the body."""
    os.write(results._writer.fileno(), struct.pack("!i", 1 << 20))
    os._exit(9)
