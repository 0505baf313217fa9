import socket, struct, sys, time, os
from lotwire import IHAVEOPT, rd
import lotwire
# Used by scripts/lot/budget_wait.sh.
# budget_wait.py PORT PID HOGS WAITERS: HOGS clients fill the byte budget with unread 1 MiB READs,
# then WAITERS clients each send one 1 MiB READ (which must wait for budget); server tasks while they wait
port=int(sys.argv[1]); pid=sys.argv[2]; hogs=int(sys.argv[3]); waiters=int(sys.argv[4])
name=b"iopages"; data=struct.pack(">I",len(name))+name+struct.pack(">H",0)
def conn(i, rcvbuf=None):
    s=socket.socket()
    if rcvbuf: s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind(("127.0.%d.%d"%(i//250, 2+i%250),0)); s.connect(("127.0.0.1",port))
    rd(s,18); s.sendall(struct.pack(">I",3)+struct.pack(">QII",IHAVEOPT,7,len(data))+data)
    while True:
        h=rd(s,20); _,opt,kind,l=struct.unpack(">QIII",h); rd(s,l)
        if kind==1: break
    return s
def tasks(): return lotwire.tasks(pid)
def cpu(): return lotwire.cpu(pid)
hs=[]
for i in range(hogs):
    s=conn(i,4096); s.sendall(b''.join(struct.pack(">IHHQQI",0x25609513,0,0,c,0,1<<20) for c in range(100))); hs.append(s)
time.sleep(1)
ws=[]
for i in range(waiters):
    s=conn(hogs+i); s.sendall(struct.pack(">IHHQQI",0x25609513,0,0,7,0,1<<20)); ws.append(s)
time.sleep(1)
c0=cpu(); t=tasks(); time.sleep(2); c1=cpu()
print("%d hogs, %d waiters: server tasks %d while they wait, CPU %d ticks in 2 s" % (hogs, waiters, t, c1-c0))
tl=[]
for k in range(8):
    a=cpu(); time.sleep(0.5); tl.append(cpu()-a)
print("ticks per 0.5 s after:", tl, "tasks", tasks())
for s in hs: s.close()
t0=time.time(); ok=0
for s in ws:
    s.settimeout(30); h=rd(s,16); m,err,c=struct.unpack(">IIQ",h)
    if err==0: rd(s,1<<20); ok+=1
print("waiters answered: %d ok of %d in %.1f s; tasks after %d" % (ok, waiters, time.time()-t0, tasks()))
