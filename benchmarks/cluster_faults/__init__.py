"""The cluster-faults benchmark (`python -m benchmarks.cluster_faults`, issue 28 item 3): a two-node Ray cluster on
this machine serving two small models (application), an open loop of predicts from a process of its own (load), a
replica, Serve's controller, the head's proxy and the worker node killed in turn, each waited on until nothing is
broken (faults, health), and per fault what clients saw against the bar (analysis, report)."""
