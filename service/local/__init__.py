"""The local launcher: `mha-serving serve` and `up` on an embedded Ray on the user's machine (ports, the Ray
environment, drain on SIGTERM). Runs in the user's process, never in a replica. No torch."""
