import socket, struct, sys, time, os
from lotwire import IHAVEOPT, rd
import lotwire, threading
# Used by scripts/lot/handshake_backlog.sh.
# handshake_backlog.py SOCK PID N LISTS: N Unix clients each pipeline LISTS NBD_OPT_LIST and read nothing; server tasks and CPU
path=sys.argv[1]; pid=sys.argv[2]; n=int(sys.argv[3]); lists=int(sys.argv[4])
def tasks(): return lotwire.tasks(pid)
def cpu(): return lotwire.cpu(pid)
msg=struct.pack(">I",3)+struct.pack(">QII",IHAVEOPT,3,0)*lists
socks=[]
for i in range(n):
    s=socket.socket(socket.AF_UNIX); s.connect(path); rd(s,18); s.setblocking(False)
    try: s.send(msg)
    except BlockingIOError: pass
    socks.append(s)
time.sleep(2)
c0=cpu(); t=tasks(); time.sleep(2); c1=cpu()
print("%d clients x %d unread LIST answers: server tasks %d, CPU %d ticks in 2 s" % (n, lists, t, c1-c0))
