"""A module that starts a thread when imported: --preload of it must make the forkserver refuse
to fork (a fork copies no thread but all their locks)."""
import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="at-import").start()
