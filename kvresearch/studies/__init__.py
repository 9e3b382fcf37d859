"""Studies of the surrogate that are not stages: leave-one-source-out fits, input probes, transfer."""
