/* qpcbuild.runtime._suffix_tree: the suffix proposer's counted suffix trie, in C.
 *
 * Bit for bit the Python SuffixTree in suffix_tree.py (PythonSuffixTree), which documents the
 * rules: what is counted, how siblings are ordered (_new_child, _grow, _shrink), the float32
 * walk and the match. Each static function below is named after the Python method it mirrors
 * and makes the same writes in the same order, so node ids (and their reuse, last freed first),
 * sibling orders, proposals, probabilities and scores all agree; freed nodes even keep the
 * same stale fields. tests/test_suffix_tree_native.py holds the two against each other.
 *
 * Why C: in the decode loop the Python tree cost ~50 us per token added and ~40 us per
 * proposal, 5-9% of a demo decode step; here the same work is a hash lookup per active suffix.
 *
 * Storage: a node is an index into flat arrays (count, token, first/last child, next/previous
 * sibling); the edges are one open-addressing hash map from (parent, token) to child with
 * linear probing and backward-shift deletion (no tombstones, so lookups stay short however
 * many sequences come and go). A sequence is its tokens plus a ring buffer of the nodes of
 * its last max_depth suffixes (the Python deque), kept in a dict from seq id to a capsule.
 *
 * Floats: every float32 operation of the Python, f32(a op b) on doubles, is written as the
 * same double operation cast to float (f32 below), exactly that. Built without -ffast-math and
 * with -ffp-contract=off (setup.py), so no multiply and add are fused into one rounding.
 *
 * Memory: what a token needs is reserved before the tree changes for it (room for max_depth new
 * nodes and edges; a free list and a stack as large as the node arrays, so removing needs no
 * memory), so a MemoryError leaves the tree as the tokens before it left it, as an error does
 * in the Python. All of it is PyMem (tracemalloc sees it) and freed in dealloc. The GIL is held
 * throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int32_t node_t;
#define ROOT 0
#define NONE (-1)
#define MAX_NODES ((Py_ssize_t)INT32_MAX)
#define TOKEN_LIMIT (1LL << 32) /* token ids are 0 .. 2**32 - 1, as the Python's edge keys */

/* What `speculate` returns: suffix_tree.Draft once suffix_tree.py has named it (set_draft_type),
 * a plain tuple (token_ids, probs, score, match_len) before. */
static PyObject *draft_type = NULL;

/* ------------------------------------------------------------------ the edge map */

#define EMPTY_KEY UINT64_MAX /* a parent id is below 2**31, so no real key has all bits set */

typedef struct {
    uint64_t *keys; /* parent << 32 | token, EMPTY_KEY where the slot is free */
    node_t *values;
    size_t mask;    /* capacity - 1; the capacity is a power of two */
    int shift;      /* 64 - log2(capacity): Fibonacci hashing keeps the top bits */
    size_t size;
} EdgeMap;

static inline uint64_t edge_key(node_t parent, uint32_t token)
{
    return ((uint64_t)(uint32_t)parent << 32) | token;
}

static inline size_t edge_home(const EdgeMap *map, uint64_t key)
{
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> map->shift);
}

static int edges_init(EdgeMap *map, int log2_capacity)
{
    size_t capacity = (size_t)1 << log2_capacity;
    map->keys = PyMem_Malloc(capacity * sizeof(uint64_t));
    map->values = PyMem_Malloc(capacity * sizeof(node_t));
    if (map->keys == NULL || map->values == NULL) {
        PyMem_Free(map->keys);
        PyMem_Free(map->values);
        map->keys = NULL;
        map->values = NULL;
        PyErr_NoMemory();
        return -1;
    }
    memset(map->keys, 0xFF, capacity * sizeof(uint64_t));
    map->mask = capacity - 1;
    map->shift = 64 - log2_capacity;
    map->size = 0;
    return 0;
}

static void edges_free(EdgeMap *map)
{
    PyMem_Free(map->keys);
    PyMem_Free(map->values);
    map->keys = NULL;
    map->values = NULL;
}

static inline node_t edges_get(const EdgeMap *map, uint64_t key)
{
    size_t slot = edge_home(map, key);
    for (;;) {
        uint64_t k = map->keys[slot];
        if (k == key)
            return map->values[slot];
        if (k == EMPTY_KEY)
            return NONE;
        slot = (slot + 1) & map->mask;
    }
}

/* Insert a key that is not in the map; edges_reserve made room for it. */
static inline void edges_put(EdgeMap *map, uint64_t key, node_t value)
{
    size_t slot = edge_home(map, key);
    while (map->keys[slot] != EMPTY_KEY)
        slot = (slot + 1) & map->mask;
    map->keys[slot] = key;
    map->values[slot] = value;
    map->size++;
}

/* Delete a key that is in the map, shifting back the entries of its probe run that would no
 * longer be found past the hole (which keeps every lookup's run unbroken without tombstones). */
static void edges_del(EdgeMap *map, uint64_t key)
{
    size_t hole = edge_home(map, key);
    while (map->keys[hole] != key)
        hole = (hole + 1) & map->mask;
    size_t slot = hole;
    for (;;) {
        slot = (slot + 1) & map->mask;
        uint64_t k = map->keys[slot];
        if (k == EMPTY_KEY)
            break;
        size_t home = edge_home(map, k);
        /* k may move into the hole when its home is not cyclically within (hole, slot] */
        if (((slot - home) & map->mask) >= ((slot - hole) & map->mask)) {
            map->keys[hole] = k;
            map->values[hole] = map->values[slot];
            hole = slot;
        }
    }
    map->keys[hole] = EMPTY_KEY;
    map->size--;
}

/* Room for `extra` more keys at a load of at most one half (short probe runs). */
static int edges_reserve(EdgeMap *map, size_t extra)
{
    size_t capacity = map->mask + 1;
    if ((map->size + extra) * 2 <= capacity)
        return 0;
    int log2_capacity = 64 - map->shift;
    while (((size_t)1 << log2_capacity) < (map->size + extra) * 2)
        log2_capacity++;
    EdgeMap grown;
    if (edges_init(&grown, log2_capacity) < 0)
        return -1;
    for (size_t slot = 0; slot < capacity; slot++) {
        if (map->keys[slot] != EMPTY_KEY)
            edges_put(&grown, map->keys[slot], map->values[slot]);
    }
    edges_free(map);
    *map = grown;
    return 0;
}

/* ------------------------------------------------------------------ sequences */

typedef struct {
    uint32_t *tokens;
    Py_ssize_t n_tokens, tokens_capacity;
    /* the Python `_active` deque: nodes of the last suffixes, a ring whose oldest (longest
     * suffix) entry is at `head`; it grows up to max_depth entries */
    node_t *active;
    Py_ssize_t head, n_active, active_capacity;
} Seq;

static const char SEQ_CAPSULE[] = "qpcbuild.runtime._suffix_tree.Seq";

static void seq_destroy(PyObject *capsule)
{
    Seq *seq = PyCapsule_GetPointer(capsule, SEQ_CAPSULE);
    if (seq != NULL) {
        PyMem_Free(seq->tokens);
        PyMem_Free(seq->active);
        PyMem_Free(seq);
    }
}

static inline node_t *seq_active_at(const Seq *seq, Py_ssize_t i)
{
    Py_ssize_t at = seq->head + i;
    if (at >= seq->active_capacity)
        at -= seq->active_capacity;
    return &seq->active[at];
}

/* Room for one more token and, while the ring is below `depth` entries, one more entry. */
static int seq_reserve(Seq *seq, Py_ssize_t depth)
{
    if (seq->n_tokens == seq->tokens_capacity) {
        Py_ssize_t capacity = seq->tokens_capacity < 16 ? 16 : seq->tokens_capacity * 2;
        uint32_t *tokens = PyMem_Realloc(seq->tokens, (size_t)capacity * sizeof(uint32_t));
        if (tokens == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        seq->tokens = tokens;
        seq->tokens_capacity = capacity;
    }
    if (seq->n_active < depth && seq->n_active == seq->active_capacity) {
        Py_ssize_t capacity = seq->active_capacity < 8 ? 8 : seq->active_capacity * 2;
        if (capacity > depth)
            capacity = depth;
        node_t *active = PyMem_Malloc((size_t)capacity * sizeof(node_t));
        if (active == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < seq->n_active; i++) /* unwrapped, oldest first */
            active[i] = *seq_active_at(seq, i);
        PyMem_Free(seq->active);
        seq->active = active;
        seq->head = 0;
        seq->active_capacity = capacity;
    }
    return 0;
}

/* ------------------------------------------------------------------ the tree object */

typedef struct {
    PyObject_HEAD
    Py_ssize_t max_depth; /* as given (the Python attribute) */
    Py_ssize_t depth;     /* max(max_depth, 0): a depth of 0 or less counts nothing */
    /* per node id, like the Python lists; ids_used is len(self._count) */
    int64_t *count;
    uint32_t *token;
    node_t *first, *last, *next, *prev;
    Py_ssize_t ids_used, ids_capacity;
    /* the free list (reused last freed first) and _drop's stack: each can hold every id, so
     * removing never needs memory it might not get */
    node_t *free_ids, *stack;
    Py_ssize_t n_free;
    EdgeMap edges;
    PyObject *seqs; /* dict: seq id -> capsule of a Seq */
} Tree;

static PyTypeObject TreeType;

/* Grow the node arrays (and the free list and stack with them) to hold `needed` ids. */
static int nodes_reserve(Tree *self, Py_ssize_t needed)
{
    if (needed <= self->ids_capacity)
        return 0;
    if (needed > MAX_NODES) {
        PyErr_SetString(PyExc_MemoryError, "the suffix tree has more than 2**31 - 1 nodes");
        return -1;
    }
    Py_ssize_t capacity = self->ids_capacity * 2;
    if (capacity < needed)
        capacity = needed;
    if (capacity > MAX_NODES)
        capacity = MAX_NODES;
    /* realloc one array at a time; each success is kept, so a failure leaves all usable */
#define GROW(field, type)                                                              \
    do {                                                                               \
        type *grown = PyMem_Realloc(self->field, (size_t)capacity * sizeof(type));     \
        if (grown == NULL) {                                                           \
            PyErr_NoMemory();                                                          \
            return -1;                                                                 \
        }                                                                              \
        self->field = grown;                                                           \
    } while (0)
    GROW(count, int64_t);
    GROW(token, uint32_t);
    GROW(first, node_t);
    GROW(last, node_t);
    GROW(next, node_t);
    GROW(prev, node_t);
    GROW(free_ids, node_t);
    GROW(stack, node_t);
#undef GROW
    self->ids_capacity = capacity;
    return 0;
}

static int Tree_traverse(Tree *self, visitproc visit, void *arg)
{
    Py_VISIT(self->seqs);
    return 0;
}

static int Tree_clear(Tree *self)
{
    Py_CLEAR(self->seqs);
    return 0;
}

static void Tree_dealloc(Tree *self)
{
    PyObject_GC_UnTrack(self);
    Tree_clear(self);
    PyMem_Free(self->count);
    PyMem_Free(self->token);
    PyMem_Free(self->first);
    PyMem_Free(self->last);
    PyMem_Free(self->next);
    PyMem_Free(self->prev);
    PyMem_Free(self->free_ids);
    PyMem_Free(self->stack);
    edges_free(&self->edges);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Tree_init(Tree *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"max_depth", NULL};
    Py_ssize_t max_depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n:SuffixTree", names, &max_depth))
        return -1;
    if (self->seqs != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "SuffixTree.__init__ runs once");
        return -1;
    }
    self->max_depth = max_depth;
    self->depth = max_depth > 0 ? max_depth : 0;
    if (nodes_reserve(self, 64) < 0 || edges_init(&self->edges, 7) < 0)
        return -1;
    self->seqs = PyDict_New();
    if (self->seqs == NULL)
        return -1;
    /* the root: Python's [0], [NONE], ... */
    self->count[ROOT] = 0;
    self->token[ROOT] = UINT32_MAX;
    self->first[ROOT] = self->last[ROOT] = self->next[ROOT] = self->prev[ROOT] = NONE;
    self->ids_used = 1;
    return 0;
}

static int tree_ready(Tree *self)
{
    if (self->seqs == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "SuffixTree.__init__ was not called");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ nodes (as in Python) */

static node_t new_child(Tree *self, node_t parent, uint32_t tok)
{
    node_t node;
    if (self->n_free > 0)
        node = self->free_ids[--self->n_free];
    else
        node = (node_t)self->ids_used++;
    self->count[node] = 1;
    self->token[node] = tok;
    self->first[node] = self->last[node] = self->next[node] = self->prev[node] = NONE;
    edges_put(&self->edges, edge_key(parent, tok), node);
    if (parent != ROOT) {
        node_t tail = self->last[parent];
        if (tail == NONE) {
            self->first[parent] = node;
        } else {
            self->next[tail] = node;
            self->prev[node] = tail;
        }
        self->last[parent] = node;
    }
    return node;
}

static void unlink_node(Tree *self, node_t parent, node_t node)
{
    node_t before = self->prev[node], after = self->next[node];
    if (before == NONE)
        self->first[parent] = after;
    else
        self->next[before] = after;
    if (after == NONE)
        self->last[parent] = before;
    else
        self->prev[after] = before;
    self->prev[node] = self->next[node] = NONE;
}

/* Put `node` in front of sibling `at` (NONE: last). */
static void insert_before(Tree *self, node_t parent, node_t node, node_t at)
{
    if (at == NONE) {
        node_t tail = self->last[parent];
        self->prev[node] = tail;
        if (tail == NONE)
            self->first[parent] = node;
        else
            self->next[tail] = node;
        self->last[parent] = node;
        return;
    }
    node_t before = self->prev[at];
    self->prev[node] = before;
    self->next[node] = at;
    self->prev[at] = node;
    if (before == NONE)
        self->first[parent] = node;
    else
        self->next[before] = node;
}

static void grow(Tree *self, node_t parent, node_t child)
{
    int64_t *count = self->count;
    int64_t c = count[child];
    node_t before = self->prev[child];
    if (before != NONE && count[before] <= c + 1) {
        int64_t target = count[before];
        node_t at = self->first[parent];
        while (count[at] != target) /* stops at `before` at the latest */
            at = self->next[at];
        unlink_node(self, parent, child);
        insert_before(self, parent, child, at);
    }
    count[child] = c + 1;
}

static void shrink(Tree *self, node_t parent, node_t child)
{
    int64_t *count = self->count;
    int64_t c = count[child];
    node_t after = self->next[child];
    if (after != NONE && count[after] == c) {
        unlink_node(self, parent, child);
        node_t at = self->first[parent];
        while (at != NONE && count[at] >= c)
            at = self->next[at];
        insert_before(self, parent, child, at);
    }
    count[child] = c - 1;
}

/* Remove `node` and everything under it; ids go on the free list in the Python's order. */
static void drop(Tree *self, node_t parent, node_t node)
{
    if (parent != ROOT)
        unlink_node(self, parent, node);
    edges_del(&self->edges, edge_key(parent, self->token[node]));
    Py_ssize_t depth = 0;
    self->stack[depth++] = node;
    while (depth > 0) {
        node_t n = self->stack[--depth];
        for (node_t child = self->first[n]; child != NONE; child = self->next[child]) {
            edges_del(&self->edges, edge_key(n, self->token[child]));
            self->stack[depth++] = child;
        }
        self->free_ids[self->n_free++] = n;
    }
}

/* ------------------------------------------------------------------ extend / remove */

/* Arguments by position or name, as a Python signature takes them; `found` borrows them. */
static int parse_arguments(const char *function, const char *const *names, Py_ssize_t n_names,
                           Py_ssize_t n_required, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames, PyObject **found)
{
    if (nargs > n_names) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %zd arguments (%zd given)",
                     function, n_names, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n_names; i++)
        found[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t n_keywords = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < n_keywords; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t i = 0;
        while (i < n_names && PyUnicode_CompareWithASCIIString(name, names[i]) != 0)
            i++;
        if (i == n_names) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'",
                         function, name);
            return -1;
        }
        if (found[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'",
                         function, names[i]);
            return -1;
        }
        found[i] = args[nargs + k];
    }
    for (Py_ssize_t i = 0; i < n_required; i++) {
        if (found[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", function,
                         names[i]);
            return -1;
        }
    }
    return 0;
}

/* int(item) as a token id, or -1 with ValueError (the Python's message) when outside range. */
static int64_t token_of(PyObject *item)
{
    PyObject *number = PyNumber_Long(item);
    if (number == NULL)
        return -1;
    int overflow;
    long long value = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (value == -1 && PyErr_Occurred()) {
        Py_DECREF(number);
        return -1;
    }
    if (overflow || value < 0 || value >= TOKEN_LIMIT) {
        PyErr_Format(PyExc_ValueError, "token id %S is outside 0 .. 2**32 - 1", number);
        Py_DECREF(number);
        return -1;
    }
    Py_DECREF(number);
    return value;
}

/* The Python extend's loop body for one token; the caller reserved everything it needs. */
static void add_token(Tree *self, Seq *seq, uint32_t tok)
{
    self->count[ROOT] += 1;
    if (self->depth > 0) {
        /* append ROOT, then drop the oldest beyond max_depth: the same as first freeing the
         * oldest entry when the ring is full */
        if (seq->n_active == self->depth) {
            seq->head = seq->head + 1 == seq->active_capacity ? 0 : seq->head + 1;
            seq->n_active--;
        }
        seq->n_active++;
        *seq_active_at(seq, seq->n_active - 1) = ROOT;
    }
    seq->tokens[seq->n_tokens++] = tok;
    for (Py_ssize_t i = 0; i < seq->n_active; i++) { /* longest suffix first */
        node_t *slot = seq_active_at(seq, i);
        node_t node = *slot;
        node_t child = edges_get(&self->edges, edge_key(node, tok));
        if (child == NONE)
            child = new_child(self, node, tok);
        else if (node == ROOT || self->first[node] == child) /* no sibling moves */
            self->count[child] += 1;
        else
            grow(self, node, child);
        *slot = child;
    }
}

/* The seq's state, created empty when new (as the Python's setdefault), and a new reference to
 * its capsule: int(token) may run Python code that removes the sequence, and the Python keeps
 * extending the list it holds then, as this keeps extending the Seq its capsule holds. */
static Seq *seq_for_extend(Tree *self, PyObject *seq_id, PyObject **capsule)
{
    *capsule = PyDict_GetItemWithError(self->seqs, seq_id);
    if (*capsule != NULL) {
        Py_INCREF(*capsule);
        return PyCapsule_GetPointer(*capsule, SEQ_CAPSULE);
    }
    if (PyErr_Occurred())
        return NULL;
    Seq *seq = PyMem_Calloc(1, sizeof(Seq));
    if (seq == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    *capsule = PyCapsule_New(seq, SEQ_CAPSULE, seq_destroy);
    if (*capsule == NULL) {
        PyMem_Free(seq);
        return NULL;
    }
    if (PyDict_SetItem(self->seqs, seq_id, *capsule) < 0) {
        Py_CLEAR(*capsule);
        return NULL;
    }
    return seq;
}

static PyObject *Tree_extend(Tree *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"seq_id", "tokens"};
    PyObject *arg[2], *capsule;
    if (parse_arguments("extend", names, 2, 2, args, nargs, kwnames, arg) < 0 ||
        tree_ready(self) < 0)
        return NULL;
    Seq *seq = seq_for_extend(self, arg[0], &capsule);
    if (seq == NULL) {
        Py_XDECREF(capsule);
        return NULL;
    }
    PyObject *iterator = PyObject_GetIter(arg[1]);
    PyObject *item;
    while (iterator != NULL && (item = PyIter_Next(iterator)) != NULL) {
        int64_t tok = token_of(item); /* may run Python code: nothing is reserved before */
        Py_DECREF(item);
        if (tok < 0)
            break;
        /* each active suffix, and the new one, may need a new node and edge */
        Py_ssize_t new_nodes = seq->n_active < self->depth ? seq->n_active + 1 : self->depth;
        if (nodes_reserve(self, self->ids_used + new_nodes) < 0 ||
            edges_reserve(&self->edges, (size_t)new_nodes) < 0 ||
            seq_reserve(seq, self->depth) < 0)
            break;
        add_token(self, seq, (uint32_t)tok);
    }
    Py_XDECREF(iterator);
    Py_DECREF(capsule);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* The Python remove's loop over the sequence's starts; it needs no memory. */
static void remove_seq(Tree *self, const Seq *seq)
{
    int64_t *count = self->count;
    for (Py_ssize_t start = 0; start < seq->n_tokens; start++) {
        node_t node = ROOT;
        count[ROOT] -= 1;
        Py_ssize_t end = seq->n_tokens - start > self->depth ? start + self->depth : seq->n_tokens;
        for (Py_ssize_t i = start; i < end; i++) {
            node_t child = edges_get(&self->edges, edge_key(node, seq->tokens[i]));
            if (child == NONE)
                break;
            if (count[child] > 1) {
                if (node == ROOT)
                    count[child] -= 1;
                else
                    shrink(self, node, child);
            } else { /* this sequence was its only occurrence: the whole branch goes */
                drop(self, node, child);
                break;
            }
            node = child;
        }
    }
}

static PyObject *Tree_remove(Tree *self, PyObject *seq_id)
{
    if (tree_ready(self) < 0)
        return NULL;
    /* dict.pop itself, for the Python's KeyError (and TypeError for an unhashable id) */
    PyObject *capsule = PyObject_CallMethod(self->seqs, "pop", "O", seq_id);
    if (capsule == NULL)
        return NULL;
    Seq *seq = PyCapsule_GetPointer(capsule, SEQ_CAPSULE);
    if (seq != NULL)
        remove_seq(self, seq);
    Py_DECREF(capsule);
    if (seq == NULL)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ floats as the Python */

/* The Python's f32: struct.pack("f", x), whose native format casts (a finite x too large
 * for float32 becomes an infinity there too). */
static inline float f32(double x)
{
    return (float)x;
}

/* The Python's _cap: int(f32(f32(match_len * f32(factor)) + f32(offset)) + 1e-6), clamped to
 * +-2**62 (a walk is never longer than max_depth, so a larger cap changes nothing). */
static int cap_of(Py_ssize_t match_len, double factor, double offset, long long *out)
{
    float sum = f32((double)f32((double)match_len * (double)f32(factor)) + (double)f32(offset));
    double x = (double)sum + 1e-6;
    if (isnan(x)) {
        PyErr_SetString(PyExc_ValueError, "cannot convert float NaN to integer");
        return -1;
    }
    if (isinf(x)) {
        PyErr_SetString(PyExc_OverflowError, "cannot convert float infinity to integer");
        return -1;
    }
    x = trunc(x);
    const double limit = 4611686018427387904.0; /* 2**62 */
    *out = x > limit ? (long long)limit : x < -limit ? -(long long)limit : (long long)x;
    return 0;
}

/* ------------------------------------------------------------------ speculate */

/* The child reached from `node` by a context token. The Python looks up the key
 * node * 2**32 + tok, which for a token outside 0 .. 2**32 - 1 (only in a context, never in
 * the tree) names the edge (node + tok // 2**32, tok % 2**32): the same edge is looked up. */
static int child_by_item(Tree *self, node_t node, PyObject *item, node_t *out)
{
    int overflow;
    long long tok = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (tok == -1 && PyErr_Occurred())
        return -1;
    if (overflow) { /* |tok| >= 2**63: the key is negative or its parent above any id */
        *out = NONE;
        return 0;
    }
    long long parent = node;
    if (tok < 0 || tok >= TOKEN_LIMIT) {
        long long high = tok >= 0 ? tok / TOKEN_LIMIT : -((-(tok + 1)) / TOKEN_LIMIT) - 1;
        parent += high; /* floor division, as Python's */
        tok -= high * TOKEN_LIMIT;
        if (parent < 0 || parent > MAX_NODES) {
            *out = NONE;
            return 0;
        }
    }
    *out = edges_get(&self->edges, edge_key((node_t)parent, (uint32_t)tok));
    return 0;
}

/* The Python's _match(context[n - match_len:]): the node of that suffix, or NONE. */
static int match_suffix(Tree *self, PyObject **context, Py_ssize_t n, Py_ssize_t match_len,
                        node_t *out)
{
    node_t node = ROOT;
    for (Py_ssize_t i = n - match_len; i < n && node != NONE; i++) {
        if (child_by_item(self, node, context[i], &node) < 0)
            return -1;
    }
    *out = node;
    return 0;
}

/* The walk's score only, as the Python's scoring loop (its tokens are collected once, for
 * the winner, by walk_draft). */
static float walk_score(const Tree *self, node_t at, long long length, float min_p)
{
    float prob = 1.0f, score = 0.0f;
    for (long long steps = 0; steps < length; steps++) {
        node_t child = self->first[at];
        if (child == NONE)
            break;
        /* f32(prob * f32(count[child] / count[at])) and f32(score + prob), as the Python */
        float ratio = f32((double)self->count[child] / (double)self->count[at]);
        prob = f32((double)prob * (double)ratio);
        if (prob < min_p)
            break;
        score = f32((double)score + (double)prob);
        at = child;
    }
    return score;
}

static PyObject *make_draft(PyObject *tokens, PyObject *probs, float score,
                            Py_ssize_t match_len)
{
    PyObject *items[4] = {tokens, probs, PyFloat_FromDouble((double)score),
                          PyLong_FromSsize_t(match_len)};
    PyObject *draft = NULL;
    if (items[2] != NULL && items[3] != NULL) {
        if (draft_type != NULL)
            draft = PyObject_Vectorcall(draft_type, items, 4, NULL);
        else
            draft = PyTuple_Pack(4, items[0], items[1], items[2], items[3]);
    }
    Py_XDECREF(items[2]);
    Py_XDECREF(items[3]);
    return draft;
}

/* The Python's _walk and the Draft built from it. */
static PyObject *walk_draft(const Tree *self, node_t node, long long max_tokens, float min_p,
                            Py_ssize_t match_len)
{
    PyObject *tokens = PyList_New(0), *probs = PyList_New(0), *draft = NULL;
    if (tokens == NULL || probs == NULL)
        goto done;
    float prob = 1.0f, score = 0.0f;
    for (long long steps = 0; steps < max_tokens; steps++) {
        node_t child = self->first[node];
        if (child == NONE)
            break;
        float ratio = f32((double)self->count[child] / (double)self->count[node]);
        prob = f32((double)prob * (double)ratio);
        if (prob < min_p)
            break;
        PyObject *tok = PyLong_FromUnsignedLong(self->token[child]);
        PyObject *p = PyFloat_FromDouble((double)prob);
        int failed = tok == NULL || p == NULL || PyList_Append(tokens, tok) < 0 ||
                     PyList_Append(probs, p) < 0;
        Py_XDECREF(tok);
        Py_XDECREF(p);
        if (failed)
            goto done;
        score = f32((double)score + (double)prob);
        node = child;
    }
    draft = make_draft(tokens, probs, score, match_len);
done:
    Py_XDECREF(tokens);
    Py_XDECREF(probs);
    return draft;
}

/* A `known` shortcut: node ids, the one of the suffix of length m at [len - m]. Either a
 * sequence's own ring (known_seq) or a Python sequence of ids (known). */
typedef struct {
    const Seq *seq;
    PyObject *fast; /* a tuple of `known`, or NULL */
    Py_ssize_t len;
} Known;

static int known_node(const Tree *self, const Known *known, Py_ssize_t match_len, node_t *out)
{
    Py_ssize_t i = known->len - match_len;
    if (known->seq != NULL) {
        *out = *seq_active_at(known->seq, i);
        return 0;
    }
    long id = PyLong_AsLong(PyTuple_GET_ITEM(known->fast, i));
    if (id == -1 && PyErr_Occurred())
        return -1;
    if (id < 0 || id >= self->ids_used) {
        PyErr_Format(PyExc_ValueError, "known holds %ld, not a node id of this tree", id);
        return -1;
    }
    *out = (node_t)id;
    return 0;
}

/* max_spec_tokens as a C integer; beyond +-2**62 it is clamped (a walk is never that long). */
static int spec_tokens_of(PyObject *value, long long *out)
{
    PyObject *number = PyNumber_Index(value);
    if (number == NULL)
        return -1;
    int overflow;
    long long n = PyLong_AsLongLongAndOverflow(number, &overflow);
    Py_DECREF(number);
    if (n == -1 && PyErr_Occurred())
        return -1;
    const long long limit = 1LL << 62;
    *out = overflow > 0 || n > limit ? limit : overflow < 0 || n < -limit ? -limit : n;
    return 0;
}

/* What the Python's speculate reads lazily, at the first match (its _cap and min): errors in
 * these arguments are raised then, and only then, as there. */
typedef struct {
    PyObject *max_spec_tokens, *factor, *offset;
} CapArgs;

/* The Python's speculate loop: every suffix of the context that is in the tree (shortest
 * first, stopping at the first one that is not), the best score winning, ties the longer. */
static PyObject *speculate_context(Tree *self, PyObject **context, Py_ssize_t n,
                                   const Known *known, const CapArgs *args, float min_p)
{
    node_t best = NONE;
    float best_score = 0.0f;
    Py_ssize_t best_len = 0;
    long long best_tokens = 0, max_spec_tokens = 0;
    int have_args = 0;
    double factor = 0.0, offset = 0.0;
    for (Py_ssize_t match_len = 1; match_len < n; match_len++) {
        node_t node;
        if (match_len <= known->len ? known_node(self, known, match_len, &node) < 0
                                    : match_suffix(self, context, n, match_len, &node) < 0)
            return NULL;
        if (node == NONE)
            break;
        if (!have_args) {
            factor = PyFloat_AsDouble(args->factor);
            if (factor == -1.0 && PyErr_Occurred())
                return NULL;
            offset = PyFloat_AsDouble(args->offset);
            if (offset == -1.0 && PyErr_Occurred())
                return NULL;
        }
        long long cap;
        if (cap_of(match_len, factor, offset, &cap) < 0)
            return NULL;
        if (!have_args && spec_tokens_of(args->max_spec_tokens, &max_spec_tokens) < 0)
            return NULL;
        have_args = 1;
        long long length = max_spec_tokens < cap ? max_spec_tokens : cap;
        if (length < 0)
            length = 0;
        float score = walk_score(self, node, length, min_p);
        if (score >= best_score) { /* ties: the longer match */
            best = node;
            best_score = score;
            best_len = match_len;
            best_tokens = length;
        }
    }
    if (best == NONE) {
        PyObject *tokens = PyList_New(0), *probs = PyList_New(0), *draft = NULL;
        if (tokens != NULL && probs != NULL)
            draft = make_draft(tokens, probs, 0.0f, 0);
        Py_XDECREF(tokens);
        Py_XDECREF(probs);
        return draft;
    }
    return walk_draft(self, best, best_tokens, min_p, best_len);
}

/* The context's items, kept alive and in place: a list as it is when it holds only ints (reading
 * them runs no Python code), else a tuple copy (an item's __index__ could change the list). */
static PyObject *context_items(PyObject *context)
{
    PyObject *fast = PySequence_Fast(context, "context must be a sequence of token ids");
    if (fast == NULL || PyTuple_CheckExact(fast))
        return fast;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        if (!PyLong_Check(items[i])) {
            PyObject *copy = PySequence_Tuple(fast);
            Py_DECREF(fast);
            return copy;
        }
    }
    return fast;
}

/* The `known` shortcut of a call: known_seq's ring (its capsule held, in `held`) or known's ids. */
static int known_of(Tree *self, PyObject *known_arg, PyObject *known_seq, Known *known,
                    PyObject **held)
{
    *held = NULL;
    if (known_seq != NULL && known_seq != Py_None) {
        PyObject *capsule = PyDict_GetItemWithError(self->seqs, known_seq);
        if (capsule == NULL)
            return PyErr_Occurred() ? -1 : 0;
        known->seq = PyCapsule_GetPointer(capsule, SEQ_CAPSULE);
        if (known->seq == NULL)
            return -1;
        known->len = known->seq->n_active;
        Py_INCREF(capsule);
        *held = capsule;
    } else if (known_arg != NULL) {
        *held = known->fast = PySequence_Tuple(known_arg);
        if (known->fast == NULL)
            return -1;
        known->len = PyTuple_GET_SIZE(known->fast);
    }
    return 0;
}

static PyObject *Tree_speculate(Tree *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    static const char *const names[] = {"context", "max_spec_tokens", "max_spec_factor",
                                        "max_spec_offset", "min_token_prob", "known",
                                        "known_seq"};
    PyObject *arg[7];
    if (parse_arguments("speculate", names, 7, 5, args, nargs, kwnames, arg) < 0 ||
        tree_ready(self) < 0)
        return NULL;
    /* min_p first, as the Python computes it before its loop */
    double min_token_prob = PyFloat_AsDouble(arg[4]);
    if (min_token_prob == -1.0 && PyErr_Occurred())
        return NULL;
    float min_p = f32(min_token_prob);
    Known known = {NULL, NULL, 0};
    PyObject *held, *context, *result = NULL;
    if (known_of(self, arg[5], arg[6], &known, &held) < 0)
        return NULL;
    context = context_items(arg[0]);
    if (context != NULL) {
        CapArgs cap_args = {arg[1], arg[2], arg[3]};
        result = speculate_context(self, PySequence_Fast_ITEMS(context),
                                   PySequence_Fast_GET_SIZE(context), &known, &cap_args, min_p);
    }
    Py_XDECREF(context);
    Py_XDECREF(held);
    return result;
}

/* ------------------------------------------------------------------ small methods */

static PyObject *Tree_suffix_nodes(Tree *self, PyObject *seq_id)
{
    if (tree_ready(self) < 0)
        return NULL;
    PyObject *capsule = PyDict_GetItemWithError(self->seqs, seq_id);
    if (capsule == NULL)
        return PyErr_Occurred() ? NULL : PyTuple_New(0);
    Seq *seq = PyCapsule_GetPointer(capsule, SEQ_CAPSULE);
    if (seq == NULL)
        return NULL;
    PyObject *nodes = PyTuple_New(seq->n_active);
    for (Py_ssize_t i = 0; nodes != NULL && i < seq->n_active; i++) {
        PyObject *id = PyLong_FromLong(*seq_active_at(seq, i));
        if (id == NULL)
            Py_CLEAR(nodes);
        else
            PyTuple_SET_ITEM(nodes, i, id);
    }
    return nodes;
}

static int Tree_contains(Tree *self, PyObject *seq_id)
{
    return tree_ready(self) < 0 ? -1 : PyDict_Contains(self->seqs, seq_id);
}

static PyObject *Tree_has(Tree *self, PyObject *seq_id)
{
    int found = Tree_contains(self, seq_id);
    return found < 0 ? NULL : PyBool_FromLong(found);
}

static PyObject *Tree_node_count(Tree *self, void *closure)
{
    if (tree_ready(self) < 0)
        return NULL;
    return PyLong_FromSsize_t(self->ids_used - self->n_free - 1);
}

/* For tests: the node tables as the Python keeps them (ids_used entries each; the root's token
 * is -1) and the free list, stale fields of freed nodes included. */
static PyObject *Tree_tables(Tree *self, PyObject *unused)
{
    if (tree_ready(self) < 0)
        return NULL;
    PyObject *lists[7] = {NULL};
    PyObject *result = NULL;
    for (int k = 0; k < 7; k++) {
        lists[k] = PyList_New(k < 6 ? self->ids_used : self->n_free);
        if (lists[k] == NULL)
            goto done;
    }
    for (Py_ssize_t i = 0; i < self->ids_used; i++) {
        long long values[6] = {self->count[i], i == ROOT ? -1 : (long long)self->token[i],
                               self->first[i], self->last[i], self->next[i], self->prev[i]};
        for (int k = 0; k < 6; k++) {
            PyObject *value = PyLong_FromLongLong(values[k]);
            if (value == NULL)
                goto done;
            PyList_SET_ITEM(lists[k], i, value);
        }
    }
    for (Py_ssize_t i = 0; i < self->n_free; i++) {
        PyObject *value = PyLong_FromLong(self->free_ids[i]);
        if (value == NULL)
            goto done;
        PyList_SET_ITEM(lists[6], i, value);
    }
    result = Py_BuildValue("{sOsOsOsOsOsOsO}", "count", lists[0], "token", lists[1], "first",
                           lists[2], "last", lists[3], "next", lists[4], "prev", lists[5],
                           "free", lists[6]);
done:
    for (int k = 0; k < 7; k++)
        Py_XDECREF(lists[k]);
    return result;
}

static PyMethodDef Tree_methods[] = {
    {"extend", (PyCFunction)(void (*)(void))Tree_extend, METH_FASTCALL | METH_KEYWORDS,
     "extend(seq_id, tokens): add tokens to a sequence (created when new)."},
    {"remove", (PyCFunction)Tree_remove, METH_O,
     "remove(seq_id): take a sequence out of the tree (KeyError when unknown)."},
    {"speculate", (PyCFunction)(void (*)(void))Tree_speculate, METH_FASTCALL | METH_KEYWORDS,
     "speculate(context, max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob,\n"
     "          known=(), known_seq=None) -> Draft\n\n"
     "known: suffix_nodes of a sequence the context ends with; known_seq: that sequence's id\n"
     "(the same shortcut without building the tuple)."},
    {"suffix_nodes", (PyCFunction)Tree_suffix_nodes, METH_O,
     "suffix_nodes(seq_id): node ids of the sequence's last suffixes, longest first."},
    {"has", (PyCFunction)Tree_has, METH_O, "has(seq_id): whether the sequence is in the tree."},
    {"_tables", (PyCFunction)Tree_tables, METH_NOARGS,
     "The node tables and free list as the Python's lists (for tests)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Tree_members[] = {
    {"max_depth", T_PYSSIZET, offsetof(Tree, max_depth), READONLY,
     "Longest substring counted."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Tree_getset[] = {
    {"node_count", (getter)Tree_node_count, NULL,
     "Nodes in the trie, the root not counted (ids of removed nodes are reused).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Tree_as_sequence = {
    .sq_contains = (objobjproc)Tree_contains,
};

static PyTypeObject TreeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "qpcbuild.runtime._suffix_tree.SuffixTree",
    .tp_doc = "SuffixTree(max_depth): suffix_tree.PythonSuffixTree in C, bit for bit.",
    .tp_basicsize = sizeof(Tree),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tree_init,
    .tp_dealloc = (destructor)Tree_dealloc,
    .tp_traverse = (traverseproc)Tree_traverse,
    .tp_clear = (inquiry)Tree_clear,
    .tp_methods = Tree_methods,
    .tp_members = Tree_members,
    .tp_getset = Tree_getset,
    .tp_as_sequence = &Tree_as_sequence,
};

/* ------------------------------------------------------------------ the module */

static PyObject *set_draft_type(PyObject *module, PyObject *cls)
{
    if (!PyCallable_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "set_draft_type takes a class");
        return NULL;
    }
    Py_INCREF(cls);
    Py_XSETREF(draft_type, cls);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_draft_type", set_draft_type, METH_O,
     "set_draft_type(cls): speculate returns cls(token_ids, probs, score, match_len)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "qpcbuild.runtime._suffix_tree",
    .m_doc = "The suffix proposer's suffix tree in C (see suffix_tree.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__suffix_tree(void)
{
    if (PyType_Ready(&TreeType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    Py_INCREF(&TreeType);
    if (PyModule_AddObject(module, "SuffixTree", (PyObject *)&TreeType) < 0) {
        Py_DECREF(&TreeType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
