#include "trainer/parallel/shard_copies.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "trainer/dist/collectives.h"

namespace elrun::trainer {
namespace {

constexpr int kHeaderTag = 71, kBytesTag = 72;
// What a rank may announce: its live shard and two pairs of copies.
constexpr int kMaxKeys = 5;
constexpr int kKeyFields = 4;  // shard, count, step, copy.

void Wait(const c10::intrusive_ptr<c10d::Work>& work) { work->wait(); }

// A view of `bytes` as a tensor (no copy; `bytes` outlives it).
torch::Tensor View(std::vector<char>& bytes) {
  return torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, torch::kUInt8);
}

std::vector<char> ToBytes(const torch::Tensor& wire) {
  const torch::Tensor cpu = wire.cpu().contiguous();
  const auto* data = reinterpret_cast<const char*>(cpu.data_ptr<uint8_t>());
  return std::vector<char>(data, data + cpu.numel());
}

}  // namespace

absl::Status ShardCopies::Refresh(c10d::Backend& pg, ShardBytes own) {
  const int rank = pg.getRank(), world = pg.getSize();
  Pair pair{std::move(own), std::nullopt};
  // A world of one, and no_shard's single shard that every rank holds: nothing to exchange.
  if (world > 1 && pair.own.count > 1) {
    const int to = (rank + world - 1) % world, from = (rank + 1) % world;
    try {
      std::vector<torch::Tensor> header_out{
          torch::tensor({static_cast<int64_t>(pair.own.bytes.size()), int64_t{pair.own.shard}, int64_t{pair.own.count},
                         pair.own.step},
                        torch::kLong)};
      std::vector<torch::Tensor> header_in{torch::empty({4}, torch::kLong)};
      auto sent = pg.send(header_out, to, kHeaderTag);
      auto received = pg.recv(header_in, from, kHeaderTag);
      Wait(sent);
      Wait(received);
      const torch::Tensor header = header_in[0];
      const int64_t size = header[0].item<int64_t>(), shard = header[1].item<int64_t>(),
                    count = header[2].item<int64_t>(), step = header[3].item<int64_t>();
      if (size < 0 || shard != from || count != pair.own.count || step != pair.own.step) {
        return absl::InternalError(absl::StrCat("shard copies: rank ", from, " sent shard ", shard, " of ", count,
                                                " at step ", step, " (", size, " bytes); expected shard ", from, " of ",
                                                pair.own.count, " at step ", pair.own.step));
      }
      std::vector<torch::Tensor> bytes_out{View(pair.own.bytes)};
      std::vector<torch::Tensor> bytes_in{torch::empty({size}, torch::kUInt8)};
      sent = pg.send(bytes_out, to, kBytesTag);
      received = pg.recv(bytes_in, from, kBytesTag);
      Wait(sent);
      Wait(received);
      ShardBytes neighbour;
      neighbour.shard = static_cast<int>(shard);
      neighbour.count = static_cast<int>(count);
      neighbour.step = step;
      neighbour.bytes = ToBytes(bytes_in[0]);
      pair.neighbour = std::move(neighbour);
    } catch (const std::exception& error) {
      return absl::UnavailableError(absl::StrCat("shard copies: ", ErrorText(error)));
    }
  }
  pairs_.push_back(std::move(pair));
  if (pairs_.size() > 2) pairs_.erase(pairs_.begin());
  return absl::OkStatus();
}

void ShardCopies::Settle() {
  if (pairs_.size() > 1) pairs_.erase(pairs_.begin(), pairs_.end() - 1);
}

std::vector<const ShardBytes*> ShardCopies::held() const {
  std::vector<const ShardBytes*> result;
  for (auto pair = pairs_.rbegin(); pair != pairs_.rend(); ++pair) {
    result.push_back(&pair->own);
    if (pair->neighbour) result.push_back(&*pair->neighbour);
  }
  return result;
}

int64_t ShardCopies::bytes() const {
  int64_t total = 0;
  for (const ShardBytes* held : held()) total += static_cast<int64_t>(held->bytes.size());
  return total;
}

std::optional<ShardSetChoice> ChooseShardSet(const std::vector<std::vector<ShardKey>>& by_rank) {
  std::set<std::pair<int64_t, int>, std::greater<>> sets;  // (step, count), newest first.
  for (const auto& keys : by_rank) {
    for (const ShardKey& key : keys) {
      if (key.count > 0 && key.shard >= 0 && key.shard < key.count && key.step >= 0) sets.insert({key.step, key.count});
    }
  }
  for (const auto& [step, count] : sets) {
    ShardSetChoice choice;
    choice.step = step;
    choice.count = count;
    choice.holders.assign(count, -1);
    std::vector<bool> holder_copy(count, true);
    for (int r = 0; r < static_cast<int>(by_rank.size()); ++r) {
      for (const ShardKey& key : by_rank[r]) {
        if (key.step != step || key.count != count || key.shard < 0 || key.shard >= count) continue;
        int& holder = choice.holders[key.shard];
        if (holder < 0 || (holder_copy[key.shard] && !key.copy)) {
          holder = r;
          holder_copy[key.shard] = key.copy;
        }
      }
    }
    if (std::find(choice.holders.begin(), choice.holders.end(), -1) != choice.holders.end()) continue;
    choice.from_copies = static_cast<int>(std::count(holder_copy.begin(), holder_copy.end(), true));
    return choice;
  }
  return std::nullopt;
}

absl::StatusOr<ShardedSync> GatherShardSet(c10d::Backend& pg, const std::optional<ShardBytes>& live,
                                           const std::vector<const ShardBytes*>& copies) {
  const int rank = pg.getRank(), world = pg.getSize();
  std::vector<std::pair<const ShardBytes*, bool>> mine;  // With "is a copy".
  if (live) mine.push_back({&*live, false});
  for (const ShardBytes* copy : copies) {
    if (static_cast<int>(mine.size()) < kMaxKeys) mine.push_back({copy, true});
  }
  ShardedSync sync;
  try {
    const torch::Device device = CommDevice(pg);
    torch::Tensor table = torch::full({world, kMaxKeys, kKeyFields}, -1, torch::kLong);
    for (size_t i = 0; i < mine.size(); ++i) {
      const ShardBytes& held = *mine[i].first;
      table[rank][i] =
          torch::tensor({int64_t{held.shard}, int64_t{held.count}, held.step, int64_t{mine[i].second}}, torch::kLong);
    }
    std::vector<torch::Tensor> all{table.to(device)};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    pg.allreduce(all, max)->wait();
    const torch::Tensor gathered = all[0].cpu().contiguous();
    const int64_t* cells = gathered.data_ptr<int64_t>();
    std::vector<std::vector<ShardKey>> by_rank(world);
    for (int r = 0; r < world; ++r) {
      for (int i = 0; i < kMaxKeys; ++i) {
        const int64_t* key = cells + (static_cast<int64_t>(r) * kMaxKeys + i) * kKeyFields;
        if (key[1] <= 0) continue;
        by_rank[r].push_back(ShardKey{static_cast<int>(key[0]), static_cast<int>(key[1]), key[2], key[3] != 0});
        if (key[3] == 0) sync.reached = std::max(sync.reached, key[2]);
      }
      if (by_rank[r].empty()) ++sync.stateless_ranks;
    }
    std::optional<ShardSetChoice> choice = ChooseShardSet(by_rank);
    if (!choice) return absl::NotFoundError("no whole set of shards is held in memory by the new group");
    sync.choice = *choice;
    for (int k = 0; k < choice->count; ++k) {
      const int holder = choice->holders[k];
      const ShardBytes* source = nullptr;
      if (rank == holder) {
        for (const auto& [held, copy] : mine) {
          if (held->shard == k && held->count == choice->count && held->step == choice->step) {
            source = held;
            if (!copy) break;  // As ChooseShardSet: a live shard first.
          }
        }
      }
      torch::Tensor size =
          torch::full({1}, source ? static_cast<int64_t>(source->bytes.size()) : int64_t{0}, torch::kLong).to(device);
      Broadcast(pg, size, holder);
      const int64_t n = size.cpu().item<int64_t>();
      torch::Tensor wire = torch::empty({n}, torch::kUInt8);
      if (source) std::memcpy(wire.data_ptr<uint8_t>(), source->bytes.data(), n);
      wire = wire.to(device);
      Broadcast(pg, wire, holder);
      sync.files.push_back(source ? source->bytes : ToBytes(wire));
      sync.bytes += n;
    }
    return sync;
  } catch (const std::exception& error) {
    return absl::UnavailableError(absl::StrCat("regroup: ", ErrorText(error)));
  }
}

}  // namespace elrun::trainer
