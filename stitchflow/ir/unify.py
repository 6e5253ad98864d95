"""Classes of (node, variable) keys for unifying index variables across producers and consumers.

A union that would put two different variables of one node into one class is refused: a
producer read at different coordinates by two consumers (GraphSAGE's relu as relu[i,k] and
relu[k,j]) is a separate copy per use, not one variable. The planner's loop nests and the gpu
target's tiling both build their classes with it.
"""

from __future__ import annotations


class VarClasses:
    def __init__(self):
        self.parent: dict = {}
        self.members: dict = {}  # root -> {node: variable}

    def find(self, key):
        if key not in self.parent:
            self.parent[key] = key
            self.members[key] = {key[0]: key[1]}
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]  # path halving
            key = self.parent[key]
        return key

    def conflicts(self, a, b) -> bool:
        """Whether joining the classes of a and b would join two variables of one node."""
        ra, rb = self.find(a), self.find(b)
        return ra != rb and not self.members[ra].keys().isdisjoint(self.members[rb])

    def union(self, a, b) -> bool:
        """Join the classes of a and b unless that conflicts; b's root names the class (the
        consumer's variable reads better in reports). True when they share a class after."""
        if self.conflicts(a, b):
            return False
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb
            self.members[rb].update(self.members.pop(ra))
        return True
