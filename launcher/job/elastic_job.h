// Runs this node's part of a multi-node job through the rendezvous (the grpc backend's
// coordinator, or the job's log in etcd with --rdzv-backend etcd-v3): join a round, run the
// workers with the ranks the coordinator assigned, report how they ended, and follow the
// coordinator's decisions - a new round after a node was lost or arrived or a worker failed
// anywhere (workers stopped, then rejoin), or the end of the job. With the grpc backend, embeds
// the coordinator when the endpoint is this machine (or is_host=1) and the port is free.
// Returns the exit code.
#ifndef ELRUN_LAUNCHER_JOB_ELASTIC_JOB_H_
#define ELRUN_LAUNCHER_JOB_ELASTIC_JOB_H_

#include <map>
#include <string>
#include <vector>

#include "launcher/spec/job_spec.h"
#include "launcher/spec/rdzv_settings.h"

namespace elrun {

int RunElasticJob(const JobSpec& spec, const std::map<std::string, std::string>& env,
                  const std::vector<std::string>& argv_template, const RdzvSettings& rdzv);

}  // namespace elrun

#endif  // ELRUN_LAUNCHER_JOB_ELASTIC_JOB_H_
