"""Discrete-event simulation of a fleet, in virtual time, through the production policies."""
