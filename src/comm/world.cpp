#include "comm/world.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>

#include "comm/detail.h"
#include "runtime/strings.h"

namespace mt::comm {

namespace {
std::mutex g_world_mu;
World* g_world = nullptr;  // never destroyed: threads may outlive main's locals
MPI_Comm g_wd_comm = MPI_COMM_NULL;

bool env_says_mpi_launcher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                        "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE", "HYDRA_CONTROL_FD"}) {
    if (std::getenv(v)) return true;
  }
  return false;
}

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char buf[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, buf, &len);
    throw CommError(std::string(what) + " failed: " + std::string(buf, static_cast<size_t>(len)));
  }
}
}  // namespace

World& World::init(int* argc, char*** argv) {
  std::lock_guard<std::mutex> lk(g_world_mu);
  if (g_world) return *g_world;
  auto* w = new World();
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  w->hostname_ = host;

  int already = 0;
  MPI_Initialized(&already);
  bool use_mpi = already || env_says_mpi_launcher();
  if (const char* e = std::getenv("MESHTRAIN_MPI")) {
    if (!std::strcmp(e, "0") && !already) use_mpi = false;
    if (!std::strcmp(e, "1")) use_mpi = true;
  }
  if (use_mpi) {
    int provided = 0;
    if (!already) {
      check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
      w->own_mpi_ = true;
    } else {
      MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_MULTIPLE)
      throw CommError(
          "the MPI library does not provide MPI_THREAD_MULTIPLE, which the communication threads "
          "need (OpenMPI: build with thread support)");
    w->mpi_ = true;
    MPI_Comm_rank(MPI_COMM_WORLD, &w->rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &w->size_);
    MPI_Comm local;
    check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, w->rank_, MPI_INFO_NULL, &local),
          "MPI_Comm_split_type");
    MPI_Comm_rank(local, &w->local_rank_);
    MPI_Comm_size(local, &w->local_size_);
    // Node index: nodes numbered by the lowest world rank they hold.
    int leader = w->rank_;
    MPI_Bcast(&leader, 1, MPI_INT, 0, local);
    MPI_Comm_free(&local);
    std::vector<int> leaders(static_cast<size_t>(w->size_));
    MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::set<int> distinct(leaders.begin(), leaders.end());
    w->num_nodes_ = static_cast<int>(distinct.size());
    w->node_ = static_cast<int>(std::distance(distinct.begin(), distinct.find(leader)));
    check(MPI_Comm_dup(MPI_COMM_WORLD, &g_wd_comm), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(g_wd_comm, MPI_ERRORS_RETURN);
  }
  detail::set_log_rank(w->rank_, w->size_);
  g_world = w;
  // The world group (its own duplicate of MPI_COMM_WORLD).
  MPI_Comm wc = MPI_COMM_NULL;
  if (w->mpi_ && w->size_ > 1) check(MPI_Comm_dup(MPI_COMM_WORLD, &wc), "MPI_Comm_dup");
  auto impl = std::make_shared<detail::GroupImpl>("world", detail::next_group_uid(), wc, w->rank_);
  detail::register_group(impl);
  w->world_ = std::make_shared<ProcessGroup>(impl);
  detail::watchdog_start(g_wd_comm);
  return *w;
}

World& World::init_meta(int size, int rank) {
  std::lock_guard<std::mutex> lk(g_world_mu);
  if (g_world) throw CommError("comm::World::init_meta: a world exists already");
  if (size < 1 || rank < 0 || rank >= size)
    throw CommError("dry run: --rank " + std::to_string(rank) + " is not a rank of a world of " + std::to_string(size));
  auto* w = new World();
  w->hostname_ = "meta";
  w->meta_ = true;
  w->rank_ = rank;
  w->size_ = size;
  detail::set_log_rank(rank, size);
  g_world = w;
  std::vector<int> all(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) all[static_cast<size_t>(r)] = r;
  auto impl = std::make_shared<detail::GroupImpl>("world", detail::next_group_uid(), rank, all,
                                                  std::make_unique<detail::MetaBackend>(rank, size));
  detail::register_group(impl);
  w->world_ = std::make_shared<ProcessGroup>(impl);
  return *w;
}

World& World::get() {
  std::lock_guard<std::mutex> lk(g_world_mu);
  if (!g_world) throw CommError("comm::World::init() has not been called");
  return *g_world;
}

bool World::initialized() {
  std::lock_guard<std::mutex> lk(g_world_mu);
  return g_world != nullptr;
}

std::shared_ptr<ProcessGroup> World::world() { return world_; }

std::shared_ptr<ProcessGroup> World::split_by(const std::function<std::pair<int, int>(int)>& color_key,
                                              const std::string& name) {
  if (!meta_) {
    const auto [color, key] = color_key(rank_);
    return split(color, key, name);
  }
  if (finalized_) throw CommError("World::split after finalize()");
  const int mine = color_key(rank_).first;
  std::vector<std::pair<int, int>> members;  // (key, world rank) of every rank with this colour
  for (int r = 0; r < size_; ++r) {
    const auto [c, k] = color_key(r);
    if (c == mine) members.push_back({k, r});
  }
  std::sort(members.begin(), members.end());
  std::vector<int> granks;
  int my = 0;
  for (const auto& [k, r] : members) {
    if (r == rank_) my = static_cast<int>(granks.size());
    granks.push_back(r);
  }
  auto impl = std::make_shared<detail::GroupImpl>(name, detail::next_group_uid(), my, granks,
                                                  std::make_unique<detail::MetaBackend>(my, static_cast<int>(granks.size())));
  detail::register_group(impl);
  return std::make_shared<ProcessGroup>(impl);
}

std::shared_ptr<ProcessGroup> World::split_like(const ProcessGroup& g, const std::string& name) {
  const std::vector<int> granks = g.global_ranks();
  if (!meta_) return split(granks.front(), g.rank(), name);
  if (finalized_) throw CommError("World::split after finalize()");
  auto impl = std::make_shared<detail::GroupImpl>(name, detail::next_group_uid(), g.rank(), granks,
                                                  std::make_unique<detail::MetaBackend>(g.rank(), g.size()));
  detail::register_group(impl);
  return std::make_shared<ProcessGroup>(impl);
}

std::shared_ptr<ProcessGroup> World::split(int color, int key, const std::string& name) {
  if (finalized_) throw CommError("World::split after finalize()");
  if (color < 0) throw CommError("World::split: color must be >= 0");
  if (meta_) throw CommError("World::split on a meta world: use split_by or split_like (group '" + name + "')");
  MPI_Comm c = MPI_COMM_NULL;
  if (mpi_ && size_ > 1) {
    check(MPI_Comm_split(MPI_COMM_WORLD, color, key, &c), "MPI_Comm_split");
    int n = 0;
    MPI_Comm_size(c, &n);
    if (n == 1) MPI_Comm_free(&c);  // a group of one needs no communicator
  }
  auto impl = std::make_shared<detail::GroupImpl>(name, detail::next_group_uid(), c, rank_);
  detail::register_group(impl);
  return std::make_shared<ProcessGroup>(impl);
}

void World::finalize() {
  if (finalized_) return;
  if (detail::job_failed()) abort("finalize() after a communication error");
  for (auto& g : detail::live_groups()) g->shutdown();
  detail::watchdog_stop();
  finalized_ = true;
  if (mpi_) {
    if (g_wd_comm != MPI_COMM_NULL) MPI_Comm_free(&g_wd_comm);
    if (own_mpi_) MPI_Finalize();
  }
}

void World::abort(const std::string& msg, int code) {
  detail::log_line("ERROR: " + msg);
  detail::fr_dump(stderr, "abort");
  detail::abort_job(code);
}

// ---------------------------------------------------------------------------------------------
// DeviceMesh

std::vector<std::pair<std::string, int>> DeviceMesh::resolve(
    std::vector<std::pair<std::string, int>> dims, int world_size) {
  if (dims.empty()) throw CommError("device mesh: no dimensions given");
  if (dims.size() > 8) throw CommError("device mesh: at most 8 dimensions");
  std::set<std::string> seen;
  int infer = -1;
  long long known = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    const auto& [name, sz] = dims[i];
    if (name.empty()) throw CommError("device mesh: a dimension has an empty name");
    if (!seen.insert(name).second)
      throw CommError("device mesh: dimension '" + name + "' appears twice");
    if (sz == -1) {
      if (infer >= 0)
        throw CommError("device mesh: only one dimension may be -1 ('" + dims[infer].first +
                        "' and '" + name + "' both are)");
      infer = static_cast<int>(i);
    } else if (sz < 1) {
      throw CommError("device mesh: dimension '" + name + "' has size " + std::to_string(sz) +
                      " (must be >= 1, or -1 for what the world size leaves)");
    } else {
      known *= sz;
    }
  }
  auto shape = [&] {
    std::string s;
    for (const auto& [n, v] : dims) s += (s.empty() ? "" : " x ") + n + "=" + std::to_string(v);
    return s;
  };
  if (infer >= 0) {
    if (world_size % known != 0)
      throw CommError("device mesh " + shape() + ": dimension '" + dims[infer].first +
                      "' cannot fill the world of " + std::to_string(world_size) +
                      " ranks: the other dimensions multiply to " + std::to_string(known) +
                      ", which does not divide it");
    dims[infer].second = static_cast<int>(world_size / known);
    return dims;
  }
  if (known == world_size) return dims;
  // Name the dimension at fault: the one whose change would make the product fit (prefer a
  // dimension > 1 from the end, where tp/dp usually are).
  std::string culprit;
  int want = 0;
  for (int i = static_cast<int>(dims.size()) - 1; i >= 0; --i) {
    long long others = known / dims[i].second;
    if (others > 0 && world_size % others == 0) {
      if (culprit.empty() || dims[i].second > 1) {
        culprit = dims[i].first;
        want = static_cast<int>(world_size / others);
        if (dims[i].second > 1) break;
      }
    }
  }
  std::string msg = "device mesh " + shape() + " has " + std::to_string(known) +
                    " ranks but the world has " + std::to_string(world_size);
  if (!culprit.empty())
    msg += ": dimension '" + culprit + "' should be " + std::to_string(want) +
           " (or set it to -1)";
  else
    msg += ": no single dimension can be changed to fit; check every dimension";
  throw CommError(msg);
}

DeviceMesh::DeviceMesh(World& world, std::vector<std::pair<std::string, int>> dims)
    : dims_(resolve(std::move(dims), world.size())) {
  const int k = static_cast<int>(dims_.size());
  coords_ = coords_of(world.rank());
  groups_.resize(size_t(1) << k);
  // Every non-empty combination, in the same order on every rank (creation is collective).
  for (unsigned mask = 1; mask < (1u << k); ++mask) {
    auto color_key = [&](int r) {
      const std::vector<int> c = coords_of(r);
      int color = 0, key = 0;
      for (int i = 0; i < k; ++i) {
        if (mask & (1u << i))
          key = key * dims_[i].second + c[i];
        else
          color = color * dims_[i].second + c[i];
      }
      return std::pair<int, int>{color, key};
    };
    // Name.
    std::vector<std::string> names;
    for (int i = 0; i < k; ++i)
      if (mask & (1u << i)) names.push_back(dims_[i].first);
    std::string name;
    if (names.size() == 2 && names[0] == "dp_replicate" && names[1] == "dp_shard")
      name = "dp";
    else if (names.size() == 3 && names[0] == "dp_replicate" && names[1] == "dp_shard" && names[2] == "cp" && k > 3)
      name = "dp_cp";  // torchtitan's names for the data-parallel ranks with the context-parallel ones
    else if (names.size() == 2 && names[0] == "dp_shard" && names[1] == "cp")
      name = "dp_shard_cp";
    else if (names.size() == static_cast<size_t>(k) && k > 1)
      name = "world";
    else
      for (const auto& n : names) name += (name.empty() ? "" : "+") + n;
    groups_[mask] = world.split_by(color_key, name);
  }
}

int DeviceMesh::index_of(const std::string& dim) const {
  for (size_t i = 0; i < dims_.size(); ++i)
    if (dims_[i].first == dim) return static_cast<int>(i);
  throw CommError("device mesh " + describe() + " has no dimension '" + dim + "'");
}

bool DeviceMesh::has(const std::string& dim) const {
  for (const auto& d : dims_)
    if (d.first == dim) return true;
  return false;
}

unsigned DeviceMesh::mask_of(std::vector<std::string> dims) const {
  if (dims.empty()) throw CommError("device mesh: group() needs at least one dimension");
  unsigned mask = 0;
  for (const auto& d : dims) {
    if (d == "dp" && !has("dp")) {
      unsigned m = 0;
      if (has("dp_replicate")) m |= 1u << index_of("dp_replicate");
      if (has("dp_shard")) m |= 1u << index_of("dp_shard");
      if (!m) throw CommError("device mesh " + describe() + " has no data-parallel dimension");
      mask |= m;
    } else if (d == "world" && !has("world")) {
      mask |= (1u << dims_.size()) - 1;
    } else {
      mask |= 1u << index_of(d);
    }
  }
  return mask;
}

std::shared_ptr<ProcessGroup> DeviceMesh::group(const std::string& dim) {
  return groups_[mask_of({dim})];
}

std::shared_ptr<ProcessGroup> DeviceMesh::group(std::vector<std::string> dims) {
  return groups_[mask_of(std::move(dims))];
}

int DeviceMesh::coord(const std::string& dim) const { return coords_[index_of(dim)]; }

std::vector<int> DeviceMesh::coords_of(int world_rank) const {
  std::vector<int> c(dims_.size());
  int rem = world_rank;
  for (int i = static_cast<int>(dims_.size()) - 1; i >= 0; --i) {
    c[static_cast<size_t>(i)] = rem % dims_[static_cast<size_t>(i)].second;
    rem /= dims_[static_cast<size_t>(i)].second;
  }
  return c;
}
int DeviceMesh::size(const std::string& dim) const { return dims_[index_of(dim)].second; }

int DeviceMesh::rank_at(const std::vector<int>& coords) const {
  if (coords.size() != dims_.size())
    throw CommError("device mesh: rank_at needs " + std::to_string(dims_.size()) + " coordinates");
  int r = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (coords[i] < 0 || coords[i] >= dims_[i].second)
      throw CommError("device mesh: coordinate " + std::to_string(coords[i]) + " outside '" +
                      dims_[i].first + "' of size " + std::to_string(dims_[i].second));
    r = r * dims_[i].second + coords[i];
  }
  return r;
}

std::string DeviceMesh::describe() const {
  std::string s;
  for (const auto& [n, v] : dims_) s += (s.empty() ? "" : " x ") + n + "=" + std::to_string(v);
  return s;
}

// ---------------------------------------------------------------------------------------------
// Printing

bool should_print(int rank) {
  if (rank == 0) return true;
  const char* v = std::getenv("MESHTRAIN_LOG_RANKS");
  if (!v) return false;
  std::string s = v;
  if (s == "all" || s == "ALL" || s == "*") return true;
  for (const std::string& item : split_list(s)) {
    char* end = nullptr;
    long r = std::strtol(item.c_str(), &end, 10);
    if (end && *end == 0 && r == rank) return true;
  }
  return false;
}

bool should_print() {
  if (World::initialized()) return should_print(World::get().rank());
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const char* e = std::getenv(v)) return should_print(std::atoi(e));
  }
  return true;
}

void log_printf(FILE* f, const char* fmt, ...) {
  if (!should_print()) return;
  char buf[4096];
  va_list ap;
  va_start(ap, fmt);
  int n = std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  std::string s;
  const char* lr = std::getenv("MESHTRAIN_LOG_RANKS");
  if (World::initialized() && World::get().size() > 1 && lr)
    s = "[rank " + std::to_string(World::get().rank()) + "] ";
  s.append(buf, std::min(static_cast<size_t>(n), sizeof buf - 1));
  std::fwrite(s.data(), 1, s.size(), f);
}

}  // namespace mt::comm
