"""Pure-Python unit tests: tree masks, merging by path, width parsing, level planning, blocks."""

from __future__ import annotations

import pytest

from specinfer.engine.scheduling.blocks import BlockAllocator, SequenceKV
from specinfer.errors import CapacityError, UserError
from specinfer.engine.drafting.tree import TokenTree, ancestor_rows, is_chain, merge_trees, visibility
from specinfer.limits import parse_tree_width
from specinfer.engine.verification.acceptance import verify_tree


def make_tree(edges: list[tuple[int, int]], root: int = 100) -> TokenTree:
    """edges: (parent node, token) in creation order."""
    tree = TokenTree.with_root(root)
    for parent, token in edges:
        tree.add_draft(parent, token)
    return tree


def test_ancestor_mask_rows():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    tree = make_tree([(0, 10), (0, 20), (1, 11), (1, 12), (2, 21)])
    assert tree.ancestors() == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert tree.depths == [0, 1, 1, 2, 2, 2]
    assert ancestor_rows([-1, 0, 1, 2]) == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert is_chain([-1, 0, 1]) and not is_chain([-1, 0, 0])
    # scratch rows hanging off a committed prefix (-1) form a forest
    assert ancestor_rows([-1, -1, 0, 1]) == [[0], [1], [0, 2], [1, 3]]


def test_duplicate_draft_reuses_its_node():
    tree = TokenTree.with_root(1)
    a = tree.add_draft(0, 7)
    b = tree.add_draft(0, 7)
    assert a == b and len(tree) == 2 and tree.children[0] == [a]


def test_merge_dedups_by_whole_path_not_token_and_depth():
    # tree A: root -> 5 -> 7 ; tree B: root -> 6 -> 7 ; token 7 at depth 2 under different parents
    a = make_tree([(0, 5), (1, 7)])
    b = make_tree([(0, 6), (1, 7), (0, 5), (3, 8)])
    merged, maps = merge_trees([a, b])
    paths = sorted(tuple(merged.path_tokens(n)) for n in range(1, len(merged)))
    assert paths == [(5,), (5, 7), (5, 8), (6,), (6, 7)]
    assert len(merged) == 6  # root + 5 distinct paths: the two 7s stay separate
    # identical paths are shared
    assert maps[0][1] == maps[1][3]  # both trees' "5" map to one node
    # parents precede children and nodes are level-ordered
    assert all(merged.parents[i] < i for i in range(1, len(merged)))
    assert merged.depths == sorted(merged.depths)


def test_merge_keeps_each_level_in_input_order():
    a = TokenTree.with_root(0)
    a.add_draft(0, 3)
    b = TokenTree.with_root(0)
    b.add_draft(0, 4)
    b.add_draft(0, 3)
    merged, maps = merge_trees([a, b])
    assert [merged.tokens[c] for c in merged.children[0]] == [3, 4]  # a's first, then b's new one
    assert maps == [[0, 1], [0, 2, 1]]


def test_merge_rejects_different_roots():
    with pytest.raises(ValueError):
        merge_trees([TokenTree.with_root(1), TokenTree.with_root(2)])


def test_greedy_walk_takes_longest_matching_path_plus_bonus():
    tree = make_tree([(0, 10), (0, 20), (1, 11), (2, 21), (3, 12)])
    # argmax per node: root->20, node2(20)->21, node4(21)->99 (no such child)
    argmax = [20, 11, 21, 12, 99, 0]
    path, bonus = verify_tree(tree, argmax)
    assert [tree.tokens[n] for n in path[1:]] == [20, 21] and bonus == 99
    path, bonus = verify_tree(tree, [42] + [0] * 5)
    assert path == [0] and bonus == 42


@pytest.mark.parametrize("text,expected", [("1,1,3,1,1,1,1,1", (1, 1, 3, 1, 1, 1, 1, 1)), (" 2, 2 ", (2, 2)), ("4", (4,))])
def test_parse_tree_width(text, expected):
    assert parse_tree_width(text) == expected


@pytest.mark.parametrize("text", ["", "1,,2", "a,b", "1,0", "-1", "1.5"])
def test_parse_tree_width_rejects_malformed(text):
    with pytest.raises(UserError, match="tree width"):
        parse_tree_width(text)


def test_block_allocator_and_sequence_slots():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    a, b = SequenceKV(alloc), SequenceKV(alloc)
    a.ensure_capacity(5)
    b.ensure_capacity(3)
    a.ensure_capacity(8)
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert a.contiguous_start(8) == 0 and a.slot(5) == 5
    a.ensure_capacity(9)
    assert a.block_table == [0, 1, 3] and a.contiguous_start(9) is None
    assert a.slots(7, 10) == [7, 12, 13]
    with pytest.raises(CapacityError):
        b.ensure_capacity(9)
    a.free()
    b.free()
    b.free()  # idempotent
    assert alloc.num_free == 4
    with pytest.raises(ValueError):
        alloc.free([0])


@pytest.mark.parametrize("parents", [
    [-1, 0, 1, 2],  # a chain
    [-1, 0, 0, 1, 1, 2],  # a tree
    [-1, 0, 1, 2, 3, 3, 4, 5, 6],  # a prompt chunk with a tree hanging off its last token
    [-1, -1, 0, 1, 2, 2],  # a forest off the committed prefix (SSM levels)
    [-1, 0, 0, 2, 3, 4],  # a branch, then a chain
])
def test_compact_visibility_equals_ancestor_rows(parents):
    limits, extras = visibility(parents)
    compact = [sorted(set(range(limit)) | set(extra)) for limit, extra in zip(limits, extras)]
    assert compact == ancestor_rows(parents)
    assert all(len(e) <= len(parents) for e in extras)
    if is_chain(parents):
        assert extras == [[] for _ in parents]
