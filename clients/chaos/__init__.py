"""`tandem chaos`: a fault-injection harness for a running deployment.

Canary requests with known greedy answers run continuously beside background load while faults are
injected one after another (SIGKILL / SIGSTOP of a worker, a cancel storm, an overload burst, a
prefill backlog); the report says, per fault, what was sent, completed and failed (by status), how
long the service took to recover, whether every completed answer was exact, and what was left over.
"""
