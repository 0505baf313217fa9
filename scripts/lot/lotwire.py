"""What scripts/lot's measurements share: reading a fixed number of bytes
from an NBD socket, the option magic, and a server process's task count
and CPU ticks (/proc/PID)."""
import os

IHAVEOPT = 0x49484156454F5054


def rd(s, k):
    """Exactly k bytes from socket s (EOFError if it closes first)."""
    b = b''
    while len(b) < k:
        x = s.recv(k - len(b))
        if not x:
            raise EOFError
        b += x
    return b


def tasks(pid):
    """Threads of process pid."""
    return len(os.listdir("/proc/%s/task" % pid))


def cpu(pid):
    """User + system CPU ticks of process pid so far."""
    f = open("/proc/%s/stat" % pid).read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])
