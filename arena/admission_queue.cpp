#include "arena/admission_queue.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace salus::arena {

namespace {

constexpr std::int32_t kNil = -1;
constexpr std::int64_t kNoCount = -1;  // max bypass of a subtree without countable requests
constexpr std::uint64_t kNoArrival = std::numeric_limits<std::uint64_t>::max();

// A treap over an index-addressed node pool (no pointers, so the pool may grow). Node
// provides left, right, prio, and static pull(pool, i) and push(pool, i): pull recomputes
// a node's subtree summary from its children, push hands a pending lazy value down.
template <typename Node>
struct Treap {
  std::vector<Node> pool;
  std::vector<std::int32_t> free_slots;
  std::int32_t root = kNil;
  std::vector<std::int32_t> path;  // scratch for erase
  std::uint64_t seed = 0x9e3779b97f4a7c15ull;

  std::uint64_t next_prio() {  // splitmix64: deterministic, so runs are reproducible
    std::uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::int32_t alloc(Node n) {
    n.left = n.right = kNil;
    n.prio = next_prio();
    std::int32_t i;
    if (free_slots.empty()) {
      i = static_cast<std::int32_t>(pool.size());
      pool.push_back(n);
    } else {
      i = free_slots.back();
      free_slots.pop_back();
      pool[static_cast<std::size_t>(i)] = n;
    }
    Node::pull(pool, i);
    return i;
  }
  Node& at(std::int32_t i) { return pool[static_cast<std::size_t>(i)]; }
  const Node& at(std::int32_t i) const { return pool[static_cast<std::size_t>(i)]; }

  // Splits t into keys < k and keys >= k.
  template <typename Key>
  std::pair<std::int32_t, std::int32_t> split(std::int32_t t, const Key& k) {
    if (t == kNil) return {kNil, kNil};
    Node::push(pool, t);
    if (at(t).key() < k) {
      auto [l, r] = split(at(t).right, k);
      at(t).right = l;
      Node::pull(pool, t);
      return {t, r};
    }
    auto [l, r] = split(at(t).left, k);
    at(t).left = r;
    Node::pull(pool, t);
    return {l, t};
  }
  std::int32_t merge(std::int32_t a, std::int32_t b) {
    if (a == kNil) return b;
    if (b == kNil) return a;
    if (at(a).prio > at(b).prio) {
      Node::push(pool, a);
      at(a).right = merge(at(a).right, b);
      Node::pull(pool, a);
      return a;
    }
    Node::push(pool, b);
    at(b).left = merge(a, at(b).left);
    Node::pull(pool, b);
    return b;
  }
  void insert(Node n) {
    const auto k = n.key();
    const std::int32_t i = alloc(n);
    auto [l, r] = split(root, k);
    root = merge(merge(l, i), r);
  }
  // Removes the node with key k and returns it, its lazy values settled.
  template <typename Key>
  Node erase(const Key& k) {
    auto [l, rest] = split(root, k);
    path.clear();
    std::int32_t t = rest;
    while (at(t).left != kNil) {  // the smallest key of `rest` is k
      Node::push(pool, t);
      path.push_back(t);
      t = at(t).left;
    }
    Node::push(pool, t);
    const Node out = at(t);
    if (path.empty()) {
      rest = at(t).right;
    } else {
      at(path.back()).left = at(t).right;
      for (auto it = path.rbegin(); it != path.rend(); ++it) Node::pull(pool, *it);
    }
    free_slots.push_back(t);
    root = merge(l, rest);
    return out;
  }
  // Calls f on the node with key k (lazy values above it pushed), then fixes the path.
  template <typename Key, typename F>
  void update(std::int32_t t, const Key& k, F&& f) {
    if (t == kNil) return;
    Node::push(pool, t);
    if (k < at(t).key()) {
      update(at(t).left, k, f);
    } else if (at(t).key() < k) {
      update(at(t).right, k, f);
    } else {
      f(at(t));
    }
    Node::pull(pool, t);
  }
  std::size_t size() const { return pool.size() - free_slots.size(); }
};

using OrderKey = std::pair<double, std::uint64_t>;  // (policy key, arrival)

// The key-ordered index: what a pass looks for is the first request that fits.
struct OrderNode {
  OrderKey k;
  SessionId session;
  Bytes persistent, total;
  Bytes min_persistent, min_total;
  std::uint64_t min_arrival;
  std::int32_t left, right;
  std::uint64_t prio;
  const OrderKey& key() const { return k; }
  static void push(std::vector<OrderNode>&, std::int32_t) {}
  static void pull(std::vector<OrderNode>& p, std::int32_t i) {
    OrderNode& n = p[static_cast<std::size_t>(i)];
    n.min_persistent = n.persistent;
    n.min_total = n.total;
    n.min_arrival = n.k.second;
    for (std::int32_t c : {n.left, n.right}) {
      if (c == kNil) continue;
      const OrderNode& m = p[static_cast<std::size_t>(c)];
      n.min_persistent = std::min(n.min_persistent, m.min_persistent);
      n.min_total = std::min(n.min_total, m.min_total);
      n.min_arrival = std::min(n.min_arrival, m.min_arrival);
    }
  }
};

// The arrival-ordered index: bypass counts, added to all earlier arrivals at once.
struct AgeNode {
  std::uint64_t arrival;
  std::int64_t bypassed;   // exact once the lazy values above it are pushed
  std::int64_t max_count;  // max bypassed over the subtree's countable (not passable) nodes
  std::int64_t lazy;       // still to be added to the children's subtrees
  bool passable;
  std::int32_t left, right;
  std::uint64_t prio;
  std::uint64_t key() const { return arrival; }
  static void apply(AgeNode& n, std::int64_t add) {
    if (!n.passable) n.bypassed += add;
    if (n.max_count != kNoCount) n.max_count += add;
    n.lazy += add;
  }
  static void push(std::vector<AgeNode>& p, std::int32_t i) {
    AgeNode& n = p[static_cast<std::size_t>(i)];
    if (n.lazy == 0) return;
    for (std::int32_t c : {n.left, n.right})
      if (c != kNil) apply(p[static_cast<std::size_t>(c)], n.lazy);
    n.lazy = 0;
  }
  static void pull(std::vector<AgeNode>& p, std::int32_t i) {
    AgeNode& n = p[static_cast<std::size_t>(i)];
    n.max_count = n.passable ? kNoCount : n.bypassed;
    for (std::int32_t c : {n.left, n.right})
      if (c != kNil) n.max_count = std::max(n.max_count, p[static_cast<std::size_t>(c)].max_count);
  }
};

}  // namespace

struct AdmissionQueue::Trees {
  Treap<OrderNode> order;
  Treap<AgeNode> age;
};

AdmissionQueue::AdmissionQueue() : trees_(std::make_unique<Trees>()) {}
AdmissionQueue::~AdmissionQueue() = default;
AdmissionQueue::AdmissionQueue(AdmissionQueue&&) noexcept = default;
AdmissionQueue& AdmissionQueue::operator=(AdmissionQueue&&) noexcept = default;

Bytes AdmissionQueue::min_persistent() const {
  const auto& t = trees_->order;
  return t.root == kNil ? kNone : t.at(t.root).min_persistent;
}

Bytes AdmissionQueue::min_total() const {
  const auto& t = trees_->order;
  return t.root == kNil ? kNone : t.at(t.root).min_total;
}

bool AdmissionQueue::push(SessionId session, std::uint64_t arrival, TimeNs now, Bytes persistent,
                          Bytes ephemeral, double key) {
  if (contains(session)) return false;
  // Arrivals are unique: the age index is keyed by them.
  for (std::int32_t t = trees_->age.root; t != kNil;) {
    const AgeNode& n = trees_->age.at(t);
    if (n.arrival == arrival) return false;
    t = arrival < n.arrival ? n.left : n.right;
  }
  info_.emplace(session, Info{key, arrival, now, persistent, ephemeral, false});
  OrderNode o{};
  o.k = {key, arrival};
  o.session = session;
  o.persistent = persistent;
  o.total = persistent + ephemeral;
  trees_->order.insert(o);
  AgeNode a{};
  a.arrival = arrival;
  trees_->age.insert(a);
  return true;
}

bool AdmissionQueue::remove(SessionId session) {
  auto it = info_.find(session);
  if (it == info_.end()) return false;
  trees_->order.erase(OrderKey{it->second.key, it->second.arrival});
  trees_->age.erase(it->second.arrival);
  info_.erase(it);
  return true;
}

bool AdmissionQueue::set_need(SessionId session, Bytes persistent, Bytes ephemeral) {
  auto it = info_.find(session);
  if (it == info_.end()) return false;
  Info& i = it->second;
  i.persistent = persistent;
  i.ephemeral = ephemeral;
  auto& t = trees_->order;
  t.update(t.root, OrderKey{i.key, i.arrival}, [&](OrderNode& n) {
    n.persistent = persistent;
    n.total = persistent + ephemeral;
  });
  return true;
}

bool AdmissionQueue::set_key(SessionId session, double key) {
  auto it = info_.find(session);
  if (it == info_.end()) return false;
  Info& i = it->second;
  if (i.key == key) return true;
  OrderNode n = trees_->order.erase(OrderKey{i.key, i.arrival});
  i.key = key;
  n.k = {key, i.arrival};
  trees_->order.insert(n);
  return true;
}

bool AdmissionQueue::set_passable(SessionId session, bool passable) {
  auto it = info_.find(session);
  if (it == info_.end()) return false;
  Info& i = it->second;
  if (i.passable == passable) return true;
  i.passable = passable;
  auto& t = trees_->age;
  t.update(t.root, i.arrival, [&](AgeNode& n) { n.passable = passable; });
  return true;
}

std::uint64_t AdmissionQueue::bypassed(std::uint64_t arrival) const {
  std::int64_t above = 0;  // lazy values of the ancestors
  for (std::int32_t t = trees_->age.root; t != kNil;) {
    const AgeNode& n = trees_->age.at(t);
    // The lazy values still above a passable node were all added while it was passable
    // (set_passable settles them first), so they do not count for it.
    if (n.arrival == arrival)
      return static_cast<std::uint64_t>(n.bypassed + (n.passable ? 0 : above));
    above += n.lazy;
    t = arrival < n.arrival ? n.left : n.right;
  }
  return 0;
}

QueuedRequest AdmissionQueue::request(SessionId session, const Info& i) const {
  QueuedRequest q;
  q.session = session;
  q.arrival = i.arrival;
  q.key = i.key;
  q.waiting_since = i.waiting_since;
  q.bypassed = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(bypassed(i.arrival), std::numeric_limits<std::uint32_t>::max()));
  q.persistent = i.persistent;
  q.ephemeral = i.ephemeral;
  q.passable = i.passable;
  return q;
}

std::optional<QueuedRequest> AdmissionQueue::find(SessionId session) const {
  auto it = info_.find(session);
  if (it == info_.end()) return std::nullopt;
  return request(session, it->second);
}

std::optional<SessionId> AdmissionQueue::next_candidate(const std::optional<OrderKey>& after,
                                                        AdmissionBounds b,
                                                        std::uint64_t latest) const {
  const auto& t = trees_->order;
  // Depth-first in key order, pruning subtrees whose smallest needs or earliest arrival
  // already rule every request in them out.
  auto search = [&](auto&& self, std::int32_t i) -> std::optional<SessionId> {
    if (i == kNil) return std::nullopt;
    const OrderNode& n = t.at(i);
    if (n.min_persistent > b.room || n.min_total > b.total || n.min_arrival > latest)
      return std::nullopt;
    const bool past = !after || *after < n.k;
    const bool below = n.k.first < b.key_below;
    if (past) {
      if (auto r = self(self, n.left)) return r;
      if (below && n.persistent <= b.room && n.total <= b.total && n.k.second <= latest)
        return n.session;
    }
    if (!below) return std::nullopt;  // the right subtree's keys are no smaller
    return self(self, n.right);
  };
  return search(search, t.root);
}

std::uint64_t AdmissionQueue::barrier(std::uint32_t cap) const {
  const auto& t = trees_->age;
  const auto limit = static_cast<std::int64_t>(cap);
  std::int64_t above = 0;
  // The leftmost countable node whose count reached the cap.
  for (std::int32_t i = t.root; i != kNil;) {
    const AgeNode& n = t.at(i);
    if (n.max_count == kNoCount || n.max_count + above < limit) return kNoArrival;
    const std::int64_t below = above + n.lazy;
    if (n.left != kNil) {
      const AgeNode& l = t.at(n.left);
      if (l.max_count != kNoCount && l.max_count + below >= limit) {
        above = below;
        i = n.left;
        continue;
      }
    }
    if (!n.passable && n.bypassed + above >= limit) return n.arrival;
    above = below;
    i = n.right;
  }
  return kNoArrival;
}

void AdmissionQueue::take(SessionId session) {
  auto it = info_.find(session);
  const Info i = it->second;
  trees_->order.erase(OrderKey{i.key, i.arrival});
  auto& age = trees_->age;
  age.erase(i.arrival);
  info_.erase(it);
  // Every request that arrived before it and still waits has now been bypassed once more.
  auto [earlier, later] = age.split(age.root, i.arrival);
  if (earlier != kNil) AgeNode::apply(age.at(earlier), 1);
  age.root = age.merge(earlier, later);
}

std::vector<SessionId> AdmissionQueue::in_key_order() const {
  std::vector<SessionId> out;
  out.reserve(info_.size());
  const auto& t = trees_->order;
  auto walk = [&](auto&& self, std::int32_t i) -> void {
    if (i == kNil) return;
    self(self, t.at(i).left);
    out.push_back(t.at(i).session);
    self(self, t.at(i).right);
  };
  walk(walk, t.root);
  return out;
}

std::string AdmissionQueue::check() const {
  const auto& o = trees_->order;
  const auto& a = trees_->age;
  if (o.size() != info_.size() || a.size() != info_.size())
    return fmt::format("admission index holds {} and {} requests, the queue {}", o.size(), a.size(),
                       info_.size());
  std::string problem;
  std::optional<OrderKey> last;
  auto walk = [&](auto&& self, std::int32_t i) -> void {
    if (i == kNil || !problem.empty()) return;
    const OrderNode& n = o.at(i);
    for (std::int32_t c : {n.left, n.right})
      if (c != kNil && o.at(c).prio > n.prio) problem = "admission index out of heap order";
    self(self, n.left);
    if (last && !(*last < n.k)) problem = "admission index out of key order";
    last = n.k;
    auto it = info_.find(n.session);
    if (it == info_.end() || it->second.key != n.k.first || it->second.arrival != n.k.second ||
        it->second.persistent != n.persistent ||
        it->second.persistent + it->second.ephemeral != n.total)
      problem = fmt::format("admission index entry of session {} is stale", n.session);
    Bytes mp = n.persistent, mt = n.total;
    std::uint64_t ma = n.k.second;
    for (std::int32_t c : {n.left, n.right}) {
      if (c == kNil) continue;
      mp = std::min(mp, o.at(c).min_persistent);
      mt = std::min(mt, o.at(c).min_total);
      ma = std::min(ma, o.at(c).min_arrival);
    }
    if (mp != n.min_persistent || mt != n.min_total || ma != n.min_arrival)
      problem = fmt::format("admission index summary at session {} is stale", n.session);
    self(self, n.right);
  };
  walk(walk, o.root);
  if (!problem.empty()) return problem;
  // The age index: arrival order, and each subtree's max the max of its exact counts.
  std::optional<std::uint64_t> prev;
  auto age = [&](auto&& self, std::int32_t i, std::int64_t above) -> std::int64_t {
    if (i == kNil || !problem.empty()) return kNoCount;
    const AgeNode& n = a.at(i);
    const std::int64_t l = self(self, n.left, above + n.lazy);
    if (prev && *prev >= n.arrival) problem = "bypass index out of arrival order";
    prev = n.arrival;
    if (n.bypassed + (n.passable ? 0 : above) < 0) problem = "bypass count below zero";
    const std::int64_t r = self(self, n.right, above + n.lazy);
    std::int64_t m = std::max(l, r);
    if (!n.passable) m = std::max(m, n.bypassed + above);
    if ((n.max_count == kNoCount ? kNoCount : n.max_count + above) != m)
      problem = "bypass index maximum is stale";
    return m;
  };
  age(age, a.root, 0);
  if (!problem.empty()) return problem;
  for (const auto& [session, i] : info_) {
    bool found = false;
    for (std::int32_t t = a.root; t != kNil && !found;) {
      const AgeNode& n = a.at(t);
      found = n.arrival == i.arrival;
      if (found && n.passable != i.passable)
        return fmt::format("queued session {}: passable flag stale", session);
      t = i.arrival < n.arrival ? n.left : n.right;
    }
    if (!found) return fmt::format("queued session {} missing from the bypass index", session);
  }
  return {};
}

}  // namespace salus::arena
