"""Canary revisions (spec.rollout Canary): the revision hash, the steps and their SLO analysis. Pure."""
